// The exact top-k of a flat f32 buffer by magnitude, as one XLA:CPU custom call.
//
// The entries lax.top_k(|x|, k) selects (NaN ranked as inf, ties to the lower
// index), in increasing index order, in the first min(k, n) of `capacity` slots;
// the slots after them hold 0 and `empty_index` (jaxcomp's EMPTY_INDEX, an
// attribute of the call). Loaded and registered by jaxcomp/_src/native.py, which
// compiles this file on first use.
//
// A threshold from a strided sample of about 65,536 entries, then one pass that
// keeps the indices of the entries at or above it (two threads, one per half),
// then the k-th largest among those and a walk in index order. Whatever the
// sample gives, the set is exact: when fewer than k entries reach the threshold,
// the pass runs again with every entry kept.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kInfBits = 0x7F800000;
constexpr int64_t kSample = 65536;
// Below this many entries one thread makes the pass.
constexpr int64_t kSplitAbove = 1 << 20;

// |x| as its int32 bits, NaN brought down to inf: ordered like the magnitudes
// (jaxcomp/_src/selection.py's _magnitude_key).
inline int32_t MagnitudeKey(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits &= 0x7FFFFFFF;
  return bits > kInfBits ? kInfBits : bits;
}

// The indices in [begin, end) whose key is at least `threshold`, increasing.
void Keep(const float* x, int64_t begin, int64_t end, int32_t threshold,
          std::vector<int32_t>* kept) {
  for (int64_t i = begin; i < end; ++i) {
    if (MagnitudeKey(x[i]) >= threshold) kept->push_back(static_cast<int32_t>(i));
  }
}

std::vector<int32_t> KeepAll(const float* x, int64_t n, int32_t threshold) {
  std::vector<int32_t> first;
  if (n < kSplitAbove) {
    Keep(x, 0, n, threshold, &first);
    return first;
  }
  std::vector<int32_t> second;
  const int64_t half = n / 2;
  // An exception must not leave the worker (it would end the process): it is
  // thrown again here, after the join.
  bool failed = false;
  std::thread worker([&] {
    try {
      Keep(x, half, n, threshold, &second);
    } catch (const std::bad_alloc&) {
      failed = true;
    }
  });
  try {
    Keep(x, 0, half, threshold, &first);
  } catch (...) {
    worker.join();
    throw;
  }
  worker.join();
  if (failed) throw std::bad_alloc();
  first.insert(first.end(), second.begin(), second.end());
  return first;
}

// The key that about 1.25 k of the n entries reach, from a strided sample.
int32_t SampledThreshold(const float* x, int64_t n, int64_t k) {
  const int64_t stride = std::max<int64_t>(1, n / kSample);
  std::vector<int32_t> sample;
  sample.reserve(n / stride + 1);
  for (int64_t i = 0; i < n; i += stride) sample.push_back(MagnitudeKey(x[i]));
  const int64_t m = static_cast<int64_t>(sample.size());
  const int64_t rank = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(1.25 * static_cast<double>(k) * m / n)), 1, m);
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                   std::greater<int32_t>());
  return sample[rank - 1];
}

ffi::Error TopkImpl(ffi::Buffer<ffi::F32> x, ffi::BufferR0<ffi::S32> k_buffer,
                    int32_t empty_index, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t capacity = static_cast<int64_t>(values->element_count());
  if (static_cast<int64_t>(indices->element_count()) != capacity) {
    return ffi::Error::InvalidArgument("values and indices must have the same size");
  }
  const int64_t k = std::clamp<int64_t>(k_buffer.typed_data()[0], 0, std::min(capacity, n));
  const float* data = x.typed_data();
  float* out_values = values->typed_data();
  int32_t* out_indices = indices->typed_data();
  int64_t slot = 0;
  try {
    if (k > 0) {
      std::vector<int32_t> kept = KeepAll(data, n, SampledThreshold(data, n, k));
      if (static_cast<int64_t>(kept.size()) < k) kept = KeepAll(data, n, 0);
      std::vector<int32_t> keys(kept.size());
      for (size_t j = 0; j < kept.size(); ++j) keys[j] = MagnitudeKey(data[kept[j]]);
      std::vector<int32_t> ranked = keys;
      std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(),
                       std::greater<int32_t>());
      const int32_t cut = ranked[k - 1];
      int64_t above = 0;
      for (int32_t key : keys) above += key > cut;
      int64_t ties = k - above;  // the first of those equal to the cut fill the rest
      for (size_t j = 0; j < kept.size() && slot < k; ++j) {
        if (keys[j] > cut || (keys[j] == cut && ties-- > 0)) {
          out_values[slot] = data[kept[j]];
          out_indices[slot] = kept[j];
          ++slot;
        }
      }
    }
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jaxcomp_topk: out of memory");
  } catch (const std::exception& error) {  // e.g. no thread could be started
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxcomp_topk: ") + error.what());
  }
  for (; slot < capacity; ++slot) {
    out_values[slot] = 0.0f;
    out_indices[slot] = empty_index;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTopk, TopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int32_t>("empty_index")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
