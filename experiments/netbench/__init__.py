"""netbench: gradient exchange steps timed over an emulated 1 and 10 Gbit/s network.

Fake devices in one process show bytes, not time. Here P worker processes
(one CPU device each) join with ``jax.distributed`` and gloo, each in its own
network namespace behind a shaped link, and time one gradient exchange step
(compress, communicate, decompress) of every compressor as a user's
``jax.jit(jax.shard_map(tx.update))`` runs it, beside PyTorch DDP's comm hooks
on the same gradient shapes. Each row holds the median step time, the bytes of
the compiled step and of the network interface, and the cost model's
prediction (:mod:`jaxcomp.costmodel`). ``--two-level`` runs nodes of several
processes with shaped uplinks; ``--pipelined`` also times a whole training
step (forward, backward, exchange, SGD) in one bucket and in 25 MiB buckets,
against its compute plus the exchange: how much of the exchange was hidden.

Run ``python -m experiments.netbench --help``. Modules: :mod:`.launcher` (the
command), :mod:`.network` (namespaces, links, shaping, teardown),
:mod:`.worker` (a JAX worker), :mod:`.torch_peer` (a torch worker),
:mod:`.workload` (shapes and methods), :mod:`.report` (goals, table, plot).
"""
