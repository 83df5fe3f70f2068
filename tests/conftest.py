"""Eight fake CPU devices for every test, set before any backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "jaxcomp",
    derandomize=True,
    deadline=None,
    max_examples=15,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile("jaxcomp")
