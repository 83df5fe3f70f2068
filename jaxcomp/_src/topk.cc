// Top-k selections of a flat f32 buffer by magnitude, as XLA:CPU custom calls.
//
// JaxcompTopk: the entries lax.top_k(|x|, k) selects (NaN ranked as inf, ties to
// the lower index), in increasing index order, in the first min(k, n) of
// `capacity` slots; the slots after them hold 0 and `empty_index` (jaxcomp's
// EMPTY_INDEX, an attribute of the call). A threshold from a strided sample of
// about 65,536 entries, then one pass that keeps the indices of the entries at or
// above it (two threads, one per half; each block of 64 entries tested at once),
// then the k-th largest among those and a walk in index order. Whatever the
// sample gives, the set is exact: when fewer than k entries reach the
// threshold, the pass runs again with every entry kept.
//
// JaxcompSampledTopk: Deep Gradient Compression's sampled threshold
// (jaxcomp/_src/selection.py's sampled_topk, the same bits) from the sample's
// positions, which the caller draws: the threshold is the rank-th largest key
// among them; then the entries of x[:size] at or above it; if their count is
// within [min_fraction * k, candidates], the min(k, count) largest of them, else
// the exact top k of x[:size], as JaxcompTopk.
//
// JaxcompTopkPerRow: each row's k entries of largest magnitude (NaN as inf),
// largest first, the lower position first on a tie, as lax.top_k of the row
// (jaxcomp/_src/selection.py's topk_per_row, the same positions and values).
//
// JaxcompTwoLevel: SparseLoCo's encoding of each row's top k (jaxcomp/_src/sparseloco.py's
// encode, the same bits): the per-row top k as JaxcompTopkPerRow, then the
// row's two magnitude levels, its 2-bit codes packed four to a byte, the decoded
// entries, and their positions in the row (uint16) and in the flat rows (int32),
// where XLA:CPU made about ten small kernels of those per gradient bucket.
//
// JaxcompSentMask: error feedback's packed mask of what was sent
// (jaxcomp/_src/error_feedback.py's sent_mask, the same bits): bit i % 32 of
// word i / 32 for each index i in [0, n), and every bit from `sent_from` on.
//
// JaxcompCorrected: error feedback's corrected gradient (jaxcomp/_src/protocol.py's
// _corrected, the same bits): the leaves (any number of f32 arrays) end to end,
// plus the residual element by element where one is given, then zeros to the
// output's length; the output is one array, or several that lie end to end (a
// method's runs). One pass that reads each leaf where it
// lies, on two threads, where XLA:CPU copies a concatenation of more than 8 arrays
// into a buffer of its own and reads it back for the addition (and fuses fewer into
// a loop that can be 100 times slower). The second thread
// inherits the caller's floating-point environment (XLA:CPU's flushes
// subnormals), so both halves add as XLA does.
//
// JaxcompMomentumCorrected: Deep Gradient Compression's momentum correction and its
// residual's addition (jaxcomp/_src/dgc.py's prepare, the same bits): from the leaves
// where they lie, the momentum and the residual, one pass that writes the corrected
// gradient and the new momentum, where XLA:CPU copied the leaves into a buffer of their
// own first, which the step's momentum then read again.
//
// JaxcompMomentumSampledTopk: JaxcompSampledTopk of DGC's corrected gradient formed in
// its pass from the leaves, the momentum and the residual (as JaxcompMomentumCorrected
// forms it, the same bits), a chunk at a time in cache: nothing of n entries is written.
//
// JaxcompMomentumMasked: DGC's state once the step is kept (jaxcomp/_src/dgc.py's step,
// the same bits), formed again from the leaves, the momentum and the residual, and
// written over them in place: the residual the corrected gradient, the momentum the new
// one, each 0 where the packed mask says the entry was sent (the dense leaves' momentum
// is given, their residual the corrected gradient masked the same way).
//
// JaxcompLowrankProduct, JaxcompFactorColumns, JaxcompLowrankResidual: the low-rank
// methods' work on a gradient bucket (jaxcomp/_src/lowrank.py), one call each where
// XLA:CPU makes a few kernels per group of equal-shaped matrices: every matrix times
// its factor (M F or M^T F, the factor's columns scaled by powers of two), each
// factor's columns scaled, refilled and orthonormalised (in double), and each
// matrix's M - P Q^T written over the residual in place. Their sums run in one fixed
// order (not XLA's), the same on every machine: the two routes agree to rounding. The
// products and the residual take M as written (one run per group), or form it a row
// at a time in cache from the leaves and the residual (the corrected gradient is then
// never written: the same bits).
//
// JaxcompIntegerEncode, JaxcompIntegerResidual: the integer codes' first encoding
// (jaxcomp/_src/quantized.py's encode, XLA:CPU's bits) of the leaves plus the residual,
// a few blocks at a time in cache, nothing of n entries written; and once the step is
// kept, its residual, the sum less its levels times their scales, over the old residual
// in place.
//
// JaxcompQsgdEncodeLeaves, JaxcompQsgdResidual: QSGD's first encoding
// (JaxcompQsgdEncode's) of the leaves plus the residual, a few blocks at a time in
// cache, and once the step is kept its residual, the sum less its decoded levels, over
// the old residual in place.
//
// JaxcompDctTopk: DeMo's selection (jaxcomp/_src/demo.py): the corrected gradient (the
// leaves plus the residual, as JaxcompCorrected forms it) cut into chunks, each chunk's
// DCT-II scaled as DeMo's, and its k coefficients of largest magnitude as
// JaxcompTopkPerRow picks them, 16 chunks at a time in cache: nothing of n entries is
// written. The transform is Lee's fast DCT (chunks of a power of two), n log2(n) / 2
// products a chunk of n where XLA:CPU's matrix product takes n^2, summed in its own
// fixed order: the routes agree to rounding.
//
// JaxcompDctResidual: DeMo's residual once the step is kept (demo.py's step, the same
// bits for the coefficients given, where it sums their basis rows): the corrected
// gradient formed again from the leaves and the residual, less the inverse DCT of what
// was sent, times the decay, written over the residual in place.
//
// JaxcompQsgdLevels, JaxcompQsgdEncode: QSGD's levels of each block (jaxcomp/_src/qsgd.py's
// quantize, the same bits) as the bytes of their int8 values, the payload QSGD sends:
// the stochastic rounding with the counter-based draws of jaxcomp/_src/draws.py, on two
// threads, where XLA:CPU's fusion ran on one. The second also takes each block's norm
// (qsgd.py's _norms: each block's from its squares, or, where any of those overflows,
// every block's from its entries brought to a unit binade) and the inverse QSGD
// multiplies by, 1 / (d u), in the same pass, where XLA:CPU made five small kernels and
// a branch; the squares are summed in the low-rank products' fixed order, not XLA's:
// the routes agree to rounding.
//
// JaxcompDensifyLeaves: a sparsifier's mean (jaxcomp/_src/collectives.py's densify,
// the same bits) written into the bucket's leaves, each once, where XLA:CPU writes the
// whole vector's zeros, scatters into it and copies each leaf out of it.
//
// Loaded and registered by jaxcomp/_src/native.py, which compiles this file on
// first use.

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

// Entries read per test of a block: wide enough that few blocks hold a kept entry.
constexpr int64_t kBlock = 64;

// Whether any of the kBlock entries from `x` may have a key at least `bound` (at
// most inf's bits + 1), in a loop the compiler vectorizes. |x|'s bits reach the
// bound wherever the key does, and only there while the bound is at most inf's
// bits (a NaN's bits exceed inf's, its key is inf's); they are non-negative, so a
// signed compare orders them.
inline bool AnyReaches(const float* x, int32_t bound) {
  int32_t bits[kBlock];
  std::memcpy(bits, x, sizeof(bits));
  int32_t any = 0;
  for (int64_t j = 0; j < kBlock; ++j) any |= (bits[j] & 0x7FFFFFFF) >= bound;
  return any != 0;
}

// Appends to `kept` the positions base + j (j < count) whose key x[j] is at least
// `threshold` (at most inf's bits, as every key), increasing, and their values to
// `values` where it is not null; false once more than `limit` are kept (the pass
// stops: then only their count past `limit` matters to the caller).
bool KeepIn(const float* x, int64_t base, int64_t count, int32_t threshold, int64_t limit,
            std::vector<int32_t>* kept, std::vector<float>* values) {
  auto keep = [&](int64_t from, int64_t to) {
    for (int64_t j = from; j < to; ++j) {
      if (MagnitudeKey(x[j]) >= threshold) {
        kept->push_back(static_cast<int32_t>(base + j));
        if (values != nullptr) values->push_back(x[j]);
        if (static_cast<int64_t>(kept->size()) > limit) return false;
      }
    }
    return true;
  };
  int64_t j = 0;
  for (; j + kBlock <= count; j += kBlock) {
    if (AnyReaches(x + j, threshold) && !keep(j, j + kBlock)) return false;
  }
  return keep(j, count);
}

// Runs `first` here and `second` on a second thread. An exception of either is
// thrown here, after the join: one that left the worker would end the process.
template <typename First, typename Second>
void InParallel(First first, Second second) {
  std::exception_ptr failure;
  std::thread worker([&] {
    try {
      second();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  try {
    first();
  } catch (...) {
    worker.join();
    throw;
  }
  worker.join();
  if (failure) std::rethrow_exception(failure);
}

// Runs `body(0, count)` here, or, where the work covers `entries` of at least
// kSplitAbove and there are two items or more, `body(0, count / 2)` here and
// `body(count / 2, count)` on a second thread.
template <typename Body>
void InHalves(int64_t count, int64_t entries, Body body) {
  if (entries < kSplitAbove || count < 2) {
    body(0, count);
  } else {
    InParallel([&] { body(0, count / 2); }, [&] { body(count / 2, count); });
  }
}

// Runs `each(j, from, to)` for each of the first `parts` parts laid end to end (part j
// spans [starts[j], starts[j + 1])) that meets [begin, end): [from, to) is where.
template <typename Each>
void OverParts(const std::vector<int64_t>& starts, size_t parts, int64_t begin, int64_t end,
               Each each) {
  for (size_t j = 0; j < parts; ++j) {
    const int64_t from = std::max(begin, starts[j]), to = std::min(end, starts[j + 1]);
    if (from < to) each(j, from, to);
  }
}

// What a pass kept: positions, increasing, and where asked their values.
struct Kept {
  std::vector<int32_t> indices;
  std::vector<float> values;
};

// `keep(begin, end, &kept)` over [0, n): on two threads, one per half, where n is at
// least kSplitAbove, the halves joined in order.
template <typename KeepSpan>
Kept KeepHalves(int64_t n, KeepSpan keep) {
  Kept first;
  if (n < kSplitAbove) {
    keep(0, n, &first);
    return first;
  }
  Kept second;
  const int64_t half = n / 2;
  InParallel([&] { keep(0, half, &first); }, [&] { keep(half, n, &second); });
  first.indices.insert(first.indices.end(), second.indices.begin(), second.indices.end());
  first.values.insert(first.values.end(), second.values.begin(), second.values.end());
  return first;
}

std::vector<int32_t> KeepAll(const float* x, int64_t n, int32_t threshold, int64_t limit) {
  return KeepHalves(n, [&](int64_t begin, int64_t end, Kept* kept) {
    KeepIn(x + begin, begin, end - begin, threshold, limit, &kept->indices, nullptr);
  }).indices;
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

// Writes the k largest keys among `kept` (increasing indices, k <= their count; the
// j-th's value value_of(j)), ties to the lower index, in index order; returns k.
template <typename ValueOf>
int64_t WriteLargest(const std::vector<int32_t>& kept, ValueOf value_of, int64_t k,
                     float* out_values, int32_t* out_indices) {
  if (k <= 0) return 0;
  std::vector<int32_t> keys(kept.size());
  for (size_t j = 0; j < kept.size(); ++j) keys[j] = MagnitudeKey(value_of(j));
  std::vector<int32_t> ranked = keys;
  std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(),
                   std::greater<int32_t>());
  const int32_t cut = ranked[k - 1];
  int64_t above = 0;
  for (int32_t key : keys) above += key > cut;
  int64_t ties = k - above;  // the first of those equal to the cut fill the rest
  int64_t slot = 0;
  for (size_t j = 0; j < kept.size() && slot < k; ++j) {
    if (keys[j] > cut || (keys[j] == cut && ties-- > 0)) {
      out_values[slot] = value_of(j);
      out_indices[slot] = kept[j];
      ++slot;
    }
  }
  return slot;
}

// The exact top k (0 <= k <= n) of data[:n], written in index order; returns k.
int64_t WriteTopk(const float* data, int64_t n, int64_t k, float* out_values,
                  int32_t* out_indices) {
  if (k <= 0) return 0;
  std::vector<int32_t> kept = KeepAll(data, n, SampledThreshold(data, n, k), n);
  if (static_cast<int64_t>(kept.size()) < k) kept = KeepAll(data, n, 0, n);
  return WriteLargest(kept, [&](size_t j) { return data[kept[j]]; }, k, out_values, out_indices);
}

// Runs `body`; an exception becomes an FFI error, never the end of the process.
template <typename Body>
ffi::Error Guarded(const char* name, Body body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(name) + ": out of memory");
  } catch (const std::exception& error) {  // e.g. no thread could be started
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(name) + ": " + error.what());
  }
  return ffi::Error::Success();
}

// Runs `select(capacity, values, indices)`, which returns the slots it wrote, then
// empties the slots past them.
template <typename Select>
ffi::Error Fill(const char* name, ffi::ResultBuffer<ffi::F32>& values,
                ffi::ResultBuffer<ffi::S32>& indices, int32_t empty_index, Select select) {
  const int64_t capacity = static_cast<int64_t>(values->element_count());
  if (static_cast<int64_t>(indices->element_count()) != capacity) {
    return ffi::Error::InvalidArgument("values and indices must have the same size");
  }
  float* out_values = values->typed_data();
  int32_t* out_indices = indices->typed_data();
  int64_t slot = 0;
  ffi::Error error = Guarded(name, [&] { slot = select(capacity, out_values, out_indices); });
  if (error.failure()) return error;
  for (; slot < capacity; ++slot) {
    out_values[slot] = 0.0f;
    out_indices[slot] = empty_index;
  }
  return ffi::Error::Success();
}

ffi::Error TopkImpl(ffi::Buffer<ffi::F32> x, ffi::BufferR0<ffi::S32> k_buffer,
                    int32_t empty_index, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  return Fill("jaxcomp_topk", values, indices, empty_index,
              [&](int64_t capacity, float* out_values, int32_t* out_indices) {
    const int64_t k = std::clamp<int64_t>(k_buffer.typed_data()[0], 0, std::min(capacity, n));
    return WriteTopk(x.typed_data(), n, k, out_values, out_indices);
  });
}

// The sample's positions, each checked to lie in [0, size), and the threshold's rank
// among them clamped to [1, their count].
ffi::Error CheckedSample(ffi::Buffer<ffi::S32>& positions, ffi::BufferR0<ffi::S32>& rank_buffer,
                         int64_t size, int64_t* rank) {
  const int64_t drawn = static_cast<int64_t>(positions.element_count());
  if (drawn < 1) return ffi::Error::InvalidArgument("the sample must hold a position");
  const int32_t* position = positions.typed_data();
  for (int64_t j = 0; j < drawn; ++j) {
    if (position[j] < 0 || position[j] >= size) {
      return ffi::Error::InvalidArgument("sample positions must lie within [0, size)");
    }
  }
  *rank = std::clamp<int64_t>(rank_buffer.typed_data()[0], 1, drawn);
  return ffi::Error::Success();
}

// jaxcomp/_src/selection.py's sampled_topk from its sample's keys: the threshold is the
// rank-th largest key; `keep(threshold, limit)` keeps the entries that reach it (at most
// limit + 1 of them, then the count is off) with `value_of(kept, j)` the j-th's value;
// a count within [min_fraction * k, candidates] gives the min(k, count) largest of
// them, any other the exact top k from `exact(out_values, out_indices)`.
template <typename KeepAbove, typename ValueOf, typename Exact>
int64_t SampledSelect(std::vector<int32_t> sample, int64_t rank, int64_t k, int64_t candidates,
                      float min_fraction, KeepAbove keep, ValueOf value_of, Exact exact,
                      float* out_values, int32_t* out_indices) {
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                   std::greater<int32_t>());
  const Kept kept = keep(sample[rank - 1], candidates);
  const int64_t total = static_cast<int64_t>(kept.indices.size());
  // In f32, as sampled_topk compares them.
  const bool enough = static_cast<float>(total) >= min_fraction * static_cast<float>(k);
  if (enough && total <= candidates) {
    return WriteLargest(kept.indices, [&](size_t j) { return value_of(kept, j); },
                        std::min(k, total), out_values, out_indices);
  }
  return exact(out_values, out_indices);
}

ffi::Error SampledTopkImpl(ffi::Buffer<ffi::F32> x, ffi::BufferR0<ffi::S32> k_buffer,
                           ffi::Buffer<ffi::S32> positions, ffi::BufferR0<ffi::S32> rank_buffer,
                           int64_t size, int64_t candidates, float min_fraction,
                           int32_t empty_index, ffi::ResultBuffer<ffi::F32> values,
                           ffi::ResultBuffer<ffi::S32> indices) {
  if (size < 1 || size > static_cast<int64_t>(x.element_count())) {
    return ffi::Error::InvalidArgument("size must be within [1, the length of x]");
  }
  int64_t rank = 0;
  if (ffi::Error error = CheckedSample(positions, rank_buffer, size, &rank); error.failure()) {
    return error;
  }
  const float* data = x.typed_data();
  return Fill("jaxcomp_sampled_topk", values, indices, empty_index,
              [&](int64_t capacity, float* out_values, int32_t* out_indices) {
    const int64_t k =
        std::clamp<int64_t>(k_buffer.typed_data()[0], 0, std::min(capacity, size));
    const int32_t* position = positions.typed_data();
    std::vector<int32_t> sample(positions.element_count());
    for (size_t j = 0; j < sample.size(); ++j) sample[j] = MagnitudeKey(data[position[j]]);
    return SampledSelect(
        std::move(sample), rank, k, candidates, min_fraction,
        [&](int32_t threshold, int64_t limit) {
          return Kept{KeepAll(data, size, threshold, limit), {}};
        },
        [&](const Kept& kept, size_t j) { return data[kept.indices[j]]; },
        [&](float* to_values, int32_t* to_indices) {
          return WriteTopk(data, size, k, to_values, to_indices);
        },
        out_values, out_indices);
  });
}

// Row `r`'s k largest (k <= width), into values[r * k...] and positions[r * k...]:
// one pass that keeps a sorted list of the k best so far; an entry enters only
// past the k-th best, so an equal key found later stays behind the earlier one.
void RowTopk(const float* row, int64_t width, int64_t k, float* values, int32_t* positions,
             int32_t* keys) {
  int64_t count = 0;
  auto offer = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const int32_t key = MagnitudeKey(row[i]);
      if (count == k && key <= keys[k - 1]) continue;
      int64_t j = count < k ? count++ : k - 1;
      for (; j > 0 && keys[j - 1] < key; --j) {
        keys[j] = keys[j - 1];
        positions[j] = positions[j - 1];
      }
      keys[j] = key;
      positions[j] = static_cast<int32_t>(i);
    }
  };
  int64_t i = 0;
  for (; i + kBlock <= width; i += kBlock) {
    // A block none of whose entries passes the k-th best is skipped after one
    // test (a NaN passes an inf k-th best there; its block is then read entry by
    // entry).
    if (count == k && !AnyReaches(row + i, keys[k - 1] + 1)) continue;
    offer(i, i + kBlock);
  }
  offer(i, width);
  for (int64_t j = 0; j < k; ++j) values[j] = row[positions[j]];
}

// Whether `rows` is [m, w] and `out` [m, k] with k in [1, w]: each row's k picked entries.
template <typename Dims>
bool PerRow(const Dims& rows, const Dims& out) {
  return rows.size() == 2 && out.size() == 2 && out[0] == rows[0] && out[1] >= 1 &&
         out[1] <= rows[1];
}

ffi::Error TopkPerRowImpl(ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> values,
                          ffi::ResultBuffer<ffi::S32> positions) {
  const auto dims = rows.dimensions();
  const auto out_dims = values->dimensions();
  if (!PerRow(dims, out_dims) || positions->element_count() != values->element_count()) {
    return ffi::Error::InvalidArgument("rows must be [m, w] and the outputs [m, k], k in [1, w]");
  }
  const int64_t count = dims[0], width = dims[1], k = out_dims[1];
  const float* data = rows.typed_data();
  float* out_values = values->typed_data();
  int32_t* out_positions = positions->typed_data();
  auto select = [&](int64_t begin, int64_t end) {
    std::vector<int32_t> keys(k);
    for (int64_t r = begin; r < end; ++r) {
      RowTopk(data + r * width, width, k, out_values + r * k, out_positions + r * k,
              keys.data());
    }
  };
  return Guarded("jaxcomp_topk_per_row", [&] { InHalves(count, count * width, select); });
}

// `op` folded over values[0..width), pairwise as jaxcomp/_src/sparseloco.py's
// _fold_columns: entry i with entry i + width / 2, an odd last entry carried to the
// next round. Overwrites `values`.
template <typename T, typename Op>
T FoldPairwise(T* values, int64_t width, Op op) {
  while (width > 1) {
    const int64_t half = width / 2;
    for (int64_t i = 0; i < half; ++i) values[i] = op(values[i], values[i + half]);
    if (width % 2) values[half] = values[2 * half];
    width = half + width % 2;
  }
  return values[0];
}

// XLA's min and max: a NaN operand gives NaN.
inline float NanMin(float a, float b) { return a != a ? a : b != b ? b : (b < a ? b : a); }
inline float NanMax(float a, float b) { return a != a ? a : b != b ? b : (b > a ? b : a); }

// One row's two-level code (jaxcomp/_src/sparseloco.py's encode, the same bits) from its
// k picked entries: the midpoint of their smallest and largest magnitude splits them,
// each side's level is its mean magnitude, and each entry is a 2-bit code (bit 0 its
// sign, bit 1 its side), four to a byte, the first in the lowest bits.
void TwoLevelRow(const float* picked, int64_t k, uint8_t* codes, float* levels, float* values,
                 float* magnitude, float* scratch) {
  for (int64_t i = 0; i < k; ++i) magnitude[i] = std::fabs(picked[i]);
  std::copy(magnitude, magnitude + k, scratch);
  const float smallest = FoldPairwise(scratch, k, NanMin);
  std::copy(magnitude, magnitude + k, scratch);
  const float largest = FoldPairwise(scratch, k, NanMax);
  // Halves before the sum, shares before the sums, as in the JAX route.
  const float middle = smallest / 2 + largest / 2;
  int32_t high_count = 0;
  for (int64_t i = 0; i < k; ++i) high_count += magnitude[i] >= middle;
  const int32_t low_count = static_cast<int32_t>(k) - high_count;
  const float high_share = 1.0f / static_cast<float>(high_count);
  const float low_share = 1.0f / static_cast<float>(std::max(low_count, 1));
  for (int64_t i = 0; i < k; ++i) {
    scratch[i] = magnitude[i] >= middle ? magnitude[i] * high_share : 0.0f;
  }
  const float high_level = FoldPairwise(scratch, k, std::plus<float>());
  for (int64_t i = 0; i < k; ++i) {
    scratch[i] = magnitude[i] >= middle ? 0.0f : magnitude[i] * low_share;
  }
  const float low_sum = FoldPairwise(scratch, k, std::plus<float>());
  levels[0] = low_count > 0 ? low_sum : high_level;
  levels[1] = high_level;
  std::fill(codes, codes + (k + 3) / 4, 0);
  for (int64_t i = 0; i < k; ++i) {
    const bool high = magnitude[i] >= middle, negative = picked[i] < 0;
    codes[i / 4] |= static_cast<uint8_t>((negative | high << 1) << (2 * (i % 4)));
    const float level = high ? levels[1] : levels[0];
    values[i] = negative ? -level : level;
  }
}

ffi::Error TwoLevelImpl(ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::U8> codes,
                        ffi::ResultBuffer<ffi::U16> positions, ffi::ResultBuffer<ffi::F32> levels,
                        ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> flat) {
  const auto dims = rows.dimensions();
  const auto out_dims = values->dimensions();
  if (!PerRow(dims, out_dims) || positions->element_count() != values->element_count() ||
      flat->element_count() != values->element_count() ||
      levels->element_count() != 2 * static_cast<size_t>(dims[0]) ||
      codes->element_count() != static_cast<size_t>(dims[0] * ((out_dims[1] + 3) / 4))) {
    return ffi::Error::InvalidArgument(
        "rows must be [m, w]; codes [m, ceil(k / 4)], positions, values and flat [m, k], k in"
        " [1, w], and levels [m, 2]");
  }
  const int64_t count = dims[0], width = dims[1], k = out_dims[1], code_bytes = (k + 3) / 4;
  const float* data = rows.typed_data();
  auto encode = [&](int64_t begin, int64_t end) {
    std::vector<int32_t> keys(k), picked_at(k);
    std::vector<float> picked(k), magnitude(k), scratch(k);
    for (int64_t r = begin; r < end; ++r) {
      RowTopk(data + r * width, width, k, picked.data(), picked_at.data(), keys.data());
      TwoLevelRow(picked.data(), k, codes->typed_data() + r * code_bytes,
                  levels->typed_data() + 2 * r, values->typed_data() + r * k,
                  magnitude.data(), scratch.data());
      for (int64_t j = 0; j < k; ++j) {
        positions->typed_data()[r * k + j] = static_cast<uint16_t>(picked_at[j]);
        flat->typed_data()[r * k + j] = static_cast<int32_t>(r * width + picked_at[j]);
      }
    }
  };
  return Guarded("jaxcomp_two_level", [&] { InHalves(count, count * width, encode); });
}

ffi::Error SentMaskImpl(ffi::Buffer<ffi::S32> indices, int64_t n, int64_t sent_from,
                        ffi::ResultBuffer<ffi::U32> mask) {
  const int64_t words = static_cast<int64_t>(mask->element_count());
  uint32_t* out = mask->typed_data();
  for (int64_t w = 0; w < words; ++w) {
    // Word w's bits at positions >= sent_from: all of them, none, or the top of one word.
    const int64_t shift = sent_from >= n ? 32 : std::clamp<int64_t>(sent_from - 32 * w, 0, 32);
    out[w] = shift >= 32 ? 0u : 0xFFFFFFFFu << shift;
  }
  const int32_t* index = indices.typed_data();
  const int64_t count = static_cast<int64_t>(indices.element_count());
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = index[j];
    // Added, not or-ed, as the JAX route's scatter does (the same for distinct positions).
    if (i >= 0 && i < n && i / 32 < words) out[i / 32] += 1u << (i % 32);
  }
  return ffi::Error::Success();
}

// Runs `each(from, i, count)` for the runs of positions [begin, min(end, n)) of the
// leaves end to end (leaf j from offsets[j], offsets ending with their total n): the
// `count` positions from i lie in one leaf, from `from`.
template <typename Each>
void OverLeaves(const std::vector<const float*>& leaves, const std::vector<int64_t>& offsets,
                int64_t begin, int64_t end, Each each) {
  const int64_t n = offsets.back();
  // The leaf that holds `begin`: the last that starts at or before it.
  size_t leaf = std::upper_bound(offsets.begin(), offsets.end() - 1, begin) - offsets.begin();
  leaf = leaf > 0 ? leaf - 1 : 0;
  for (int64_t i = begin; i < std::min(end, n); ++leaf) {
    const int64_t stop = std::min(end, offsets[leaf + 1]);
    if (stop <= i) continue;  // an empty leaf
    each(leaves[leaf] + (i - offsets[leaf]), i, stop - i);
    i = stop;
  }
}

// Positions [begin, end) of the leaves end to end, plus residual[i] where it is not
// null, and 0 past n, written to `out`, which holds position `out_start` first.
void CorrectedSpan(const std::vector<const float*>& leaves, const std::vector<int64_t>& offsets,
                   const float* residual, float* out, int64_t out_start, int64_t begin,
                   int64_t end) {
  OverLeaves(leaves, offsets, begin, end, [&](const float* from, int64_t i, int64_t count) {
    float* to = out + (i - out_start);
    if (residual == nullptr) {
      std::memcpy(to, from, count * sizeof(float));
    } else {
      const float* add = residual + i;
      for (int64_t j = 0; j < count; ++j) to[j] = from[j] + add[j];
    }
  });
  const int64_t n = offsets.back();
  if (end > n) {
    const int64_t from = std::max(begin, n);
    std::memset(out + (from - out_start), 0, (end - from) * sizeof(float));
  }
}

// jaxcomp/_src/binade.py's unit_factor of a magnitude given as its bits (NaN's above
// inf's): the power of two that brings it into [1, 2), kept a normal float.
float UnitFactor(int32_t magnitude_bits) {
  const int32_t exponent = std::clamp<int32_t>(254 - (magnitude_bits >> 23), 1, 254);
  const int32_t bits = exponent << 23;
  float factor;
  std::memcpy(&factor, &bits, sizeof(factor));
  return factor;
}

// A row times a column is summed in kLanes interleaved sums, joined pairwise, then
// the tail's: one fixed order, whatever the machine.
constexpr int64_t kLanes = 8;

// The lanes joined pairwise: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline float Joined(const float* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// The sums' loops are also built for AVX2 where the compiler can, picked at load
// time on a CPU that has it: the same operations in the same order (no product and
// sum fused, -ffp-contract=off), in wider registers.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define JAXCOMP_WIDE __attribute__((target_clones("avx2", "default")))
#else
#define JAXCOMP_WIDE
#endif

// ------------------------------------------------------------------- block norms

// The sum of (x[k] f)^2 over a block of n entries (f a power of two), in the lanes'
// order: QSGD's squares (jaxcomp/_src/qsgd.py's _norms).
JAXCOMP_WIDE float SumOfSquares(const float* x, int64_t n, float f) {
  const int64_t whole = n - n % kLanes;
  float lane[kLanes] = {};
  for (int64_t k = 0; k < whole; k += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = x[k + l] * f;
      lane[l] += v * v;
    }
  }
  float tail = 0.0f;
  for (int64_t k = whole; k < n; ++k) {
    const float v = x[k] * f;
    tail += v * v;
  }
  return Joined(lane) + tail;
}

// The largest magnitude key (NaN as inf) of the n entries at x.
int32_t LargestKey(const float* x, int64_t n) {
  int32_t top = 0;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, MagnitudeKey(x[j]));
  return top;
}

// Blocks [first, last) of `block` entries at x: each one's L2 norm from its squares.
void PlainNorms(const float* x, int64_t block, int64_t first, int64_t last, float* norms) {
  for (int64_t b = first; b < last; ++b) {
    norms[b] = std::sqrt(SumOfSquares(x + b * block, block, 1.0f));
  }
}

// Each block's norm as jaxcomp/_src/binade.py's unit_norm gives it: the block brought
// to its largest magnitude's unit binade (NaN as inf), its norm, then the factor
// divided out (exact where nothing underflows): finite for a finite block whose norm
// fits in f32, where its squares overflow.
void ScaledNorms(const float* x, int64_t block, int64_t first, int64_t last, float* norms) {
  for (int64_t b = first; b < last; ++b) {
    const float* entries = x + b * block;
    const float f = UnitFactor(LargestKey(entries, block));
    norms[b] = std::sqrt(SumOfSquares(entries, block, f)) / f;
  }
}

// A divisor of 0 taken as 1, zero by its bits as XLA:CPU's compare finds it: a subnormal
// is not zero there, though the arithmetic of both flushes it.
inline float Divisor(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x7FFFFFFF) == 0 ? 1.0f : value;
}

// A norm's inverse as QSGD divides by it, 1 / (d u), d the norm (Divisor) and u
// unit_factor(d). A norm is never subnormal (XLA:CPU's and these calls' sums flush
// it), so that d is the JAX route's, whichever compare finds its zero.
inline float NormInverse(float norm) {
  const float divisor = Divisor(norm);
  return 1.0f / (divisor * UnitFactor(MagnitudeKey(divisor)));
}

// Each f32 leaf's data into `data`, and where each starts when they lie end to end into
// `offsets` (from 0, then their total).
ffi::Error LeafData(ffi::RemainingArgs& leaves, std::vector<const float*>* data,
                    std::vector<int64_t>* offsets) {
  offsets->assign(1, 0);
  for (size_t j = 0; j < leaves.size(); ++j) {
    auto leaf = leaves.get<ffi::Buffer<ffi::F32>>(j);
    if (!leaf.has_value()) return leaf.error();
    data->push_back(leaf->typed_data());
    offsets->push_back(offsets->back() + static_cast<int64_t>(leaf->element_count()));
  }
  return ffi::Error::Success();
}

ffi::Error CorrectedImpl(ffi::Buffer<ffi::F32> residual, ffi::RemainingArgs leaves,
                         ffi::RemainingRets results) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  // The output is the parts end to end.
  const size_t count = results.size();
  std::vector<float*> out;
  std::vector<int64_t> starts = {0};
  for (size_t j = 0; j < count; ++j) {
    auto result = results.get<ffi::Buffer<ffi::F32>>(j);
    if (!result.has_value()) return result.error();
    out.push_back((*result)->typed_data());
    starts.push_back(starts.back() + static_cast<int64_t>((*result)->element_count()));
  }
  const int64_t n = offsets.back();
  const int64_t length = starts[count];
  const int64_t given = static_cast<int64_t>(residual.element_count());
  if (length < n || (given != 0 && given != n)) {
    return ffi::Error::InvalidArgument(
        "the outputs must hold the leaves, and the residual be as long as they are or empty");
  }
  const float* add = given == 0 ? nullptr : residual.typed_data();
  return Guarded("jaxcomp_corrected", [&] {
    // Positions [begin, end) of the output, part by part.
    InHalves(length, length, [&](int64_t begin, int64_t end) {
      OverParts(starts, count, begin, end, [&](size_t j, int64_t from, int64_t to) {
        CorrectedSpan(data, offsets, add, out[j], starts[j], from, to);
      });
    });
  });
}

// --------------------------------------------------------------- momentum correction

// Deep Gradient Compression's new momentum, u' = m u + g (Nesterov: m (u + g)), and
// the corrected gradient of a sparse position, its velocity (u', Nesterov u' + g) plus
// the residual: one f32 operation each, as jaxcomp/_src/dgc.py's accumulate, then
// error feedback's addition.
inline float NextMomentum(float coefficient, float u, float g, bool nesterov) {
  return nesterov ? coefficient * (u + g) : coefficient * u + g;
}
inline float Corrected(float next, float g, float e, bool nesterov) {
  return (nesterov ? next + g : next) + e;
}

// DGC's momentum correction at positions [begin, end) of the leaves end to end
// (jaxcomp/_src/dgc.py's prepare, then error feedback's addition, the same bits): each
// position's new momentum written to `momentum_out`; and its corrected gradient, the
// velocity plus the residual on the first `head` positions (the sparse leaves), the
// gradient plus the residual on the rest, written to `corrected`.
void MomentumSpan(const std::vector<const float*>& leaves, const std::vector<int64_t>& offsets,
                  const float* momentum, const float* residual, int64_t head, float coefficient,
                  bool nesterov, float* corrected, float* momentum_out, int64_t begin,
                  int64_t end) {
  OverLeaves(leaves, offsets, begin, end, [&](const float* g, int64_t i, int64_t count) {
    const float* u = momentum + i;
    const float* e = residual + i;
    float* out = corrected + i;
    float* u_out = momentum_out + i;
    const int64_t sparse = std::clamp<int64_t>(head - i, 0, count);
    // Each form in loops of its own, which the compiler vectorizes.
    if (nesterov) {
      for (int64_t j = 0; j < count; ++j) u_out[j] = NextMomentum(coefficient, u[j], g[j], true);
      for (int64_t j = 0; j < sparse; ++j) out[j] = Corrected(u_out[j], g[j], e[j], true);
    } else {
      for (int64_t j = 0; j < count; ++j) u_out[j] = NextMomentum(coefficient, u[j], g[j], false);
      for (int64_t j = 0; j < sparse; ++j) out[j] = Corrected(u_out[j], g[j], e[j], false);
    }
    for (int64_t j = sparse; j < count; ++j) out[j] = g[j] + e[j];
  });
}

ffi::Error MomentumCorrectedImpl(ffi::Buffer<ffi::F32> momentum, ffi::Buffer<ffi::F32> residual,
                                 ffi::RemainingArgs leaves, int64_t head, float coefficient,
                                 int64_t nesterov, ffi::ResultBuffer<ffi::F32> corrected,
                                 ffi::ResultBuffer<ffi::F32> new_momentum) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  const int64_t n = offsets.back();
  if (static_cast<int64_t>(momentum.element_count()) != n ||
      static_cast<int64_t>(residual.element_count()) != n ||
      static_cast<int64_t>(corrected->element_count()) != n ||
      static_cast<int64_t>(new_momentum->element_count()) != n || head < 0 || head > n) {
    return ffi::Error::InvalidArgument(
        "the momentum, the residual and both outputs must be as long as the leaves, and the"
        " head within them");
  }
  return Guarded("jaxcomp_momentum_corrected", [&] {
    InHalves(n, n, [&](int64_t first, int64_t last) {
      MomentumSpan(data, offsets, momentum.typed_data(), residual.typed_data(), head,
                   coefficient, nesterov != 0, corrected->typed_data(),
                   new_momentum->typed_data(), first, last);
    });
  });
}

// The corrected gradient of `count` sparse positions, whose gradient, momentum and
// residual start at g, u and e, written to `out` (MomentumSpan's, not stored there).
void VelocityRun(const float* g, const float* u, const float* e, int64_t count,
                 float coefficient, bool nesterov, float* out) {
  if (nesterov) {
    for (int64_t j = 0; j < count; ++j) {
      out[j] = Corrected(NextMomentum(coefficient, u[j], g[j], true), g[j], e[j], true);
    }
  } else {
    for (int64_t j = 0; j < count; ++j) {
      out[j] = Corrected(NextMomentum(coefficient, u[j], g[j], false), g[j], e[j], false);
    }
  }
}

// The momentum, the residual and the leaves of a DGC call, with the momentum's form.
struct MomentumInputs {
  std::vector<const float*> leaves;
  std::vector<int64_t> offsets;
  const float* momentum;
  const float* residual;
  float coefficient;
  bool nesterov;

  // The corrected gradient at positions [begin, end) (sparse ones), into `out`.
  void Velocities(int64_t begin, int64_t end, float* out) const {
    OverLeaves(leaves, offsets, begin, end, [&](const float* g, int64_t i, int64_t count) {
      VelocityRun(g, momentum + i, residual + i, count, coefficient, nesterov, out + (i - begin));
    });
  }
};

// Entries of the corrected gradient formed at a time, in cache, for the threshold's test.
constexpr int64_t kChunk = 4096;

ffi::Error MomentumSampledTopkImpl(ffi::Buffer<ffi::F32> momentum, ffi::Buffer<ffi::F32> residual,
                                   ffi::BufferR0<ffi::S32> k_buffer,
                                   ffi::Buffer<ffi::S32> positions,
                                   ffi::BufferR0<ffi::S32> rank_buffer, ffi::RemainingArgs leaves,
                                   int64_t size, float coefficient, int64_t nesterov,
                                   int64_t candidates, float min_fraction, int32_t empty_index,
                                   ffi::ResultBuffer<ffi::F32> values,
                                   ffi::ResultBuffer<ffi::S32> indices) {
  MomentumInputs in{{}, {}, momentum.typed_data(), residual.typed_data(), coefficient,
                    nesterov != 0};
  if (ffi::Error error = LeafData(leaves, &in.leaves, &in.offsets); error.failure()) return error;
  const int64_t n = in.offsets.back();
  if (static_cast<int64_t>(momentum.element_count()) != n ||
      static_cast<int64_t>(residual.element_count()) != n || size < 1 || size > n) {
    return ffi::Error::InvalidArgument(
        "the momentum and the residual must be as long as the leaves, and size within"
        " [1, their length]");
  }
  int64_t rank = 0;
  if (ffi::Error error = CheckedSample(positions, rank_buffer, size, &rank); error.failure()) {
    return error;
  }
  return Fill("jaxcomp_momentum_sampled_topk", values, indices, empty_index,
              [&](int64_t capacity, float* out_values, int32_t* out_indices) {
    const int64_t k =
        std::clamp<int64_t>(k_buffer.typed_data()[0], 0, std::min(capacity, size));
    const int32_t* position = positions.typed_data();
    std::vector<int32_t> sample(positions.element_count());
    // Run by run of consecutive positions (the sample's runs of 32), each formed at once.
    std::vector<float> run;
    for (size_t j = 0; j < sample.size();) {
      size_t stop = j + 1;
      while (stop < sample.size() && position[stop] == position[stop - 1] + 1) ++stop;
      run.resize(stop - j);
      in.Velocities(position[j], position[j] + static_cast<int64_t>(stop - j), run.data());
      for (size_t r = j; r < stop; ++r) sample[r] = MagnitudeKey(run[r - j]);
      j = stop;
    }
    auto keep = [&](int32_t threshold, int64_t limit) {
      return KeepHalves(size, [&](int64_t begin, int64_t end, Kept* kept) {
        std::vector<float> chunk(kChunk);
        for (int64_t from = begin; from < end; from += kChunk) {
          const int64_t count = std::min(kChunk, end - from);
          in.Velocities(from, from + count, chunk.data());
          if (!KeepIn(chunk.data(), from, count, threshold, limit, &kept->indices,
                      &kept->values)) {
            return;
          }
        }
      });
    };
    return SampledSelect(
        std::move(sample), rank, k, candidates, min_fraction, keep,
        [&](const Kept& kept, size_t j) { return kept.values[j]; },
        [&](float* to_values, int32_t* to_indices) {
          std::vector<float> corrected(size);
          InHalves(size, size, [&](int64_t first, int64_t last) {
            in.Velocities(first, last, corrected.data() + first);
          });
          return WriteTopk(corrected.data(), size, k, to_values, to_indices);
        },
        out_values, out_indices);
  });
}

ffi::Error MomentumMaskedImpl(ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> momentum,
                              ffi::Buffer<ffi::U32> sent, ffi::Buffer<ffi::F32> dense_momentum,
                              ffi::RemainingArgs leaves, int64_t head, float coefficient,
                              int64_t nesterov, ffi::ResultBuffer<ffi::F32> new_residual,
                              ffi::ResultBuffer<ffi::F32> new_momentum) {
  MomentumInputs in{{}, {}, momentum.typed_data(), residual.typed_data(), coefficient,
                    nesterov != 0};
  if (ffi::Error error = LeafData(leaves, &in.leaves, &in.offsets); error.failure()) return error;
  const int64_t n = in.offsets.back();
  if (static_cast<int64_t>(momentum.element_count()) != n ||
      static_cast<int64_t>(residual.element_count()) != n ||
      static_cast<int64_t>(new_momentum->element_count()) != n ||
      static_cast<int64_t>(new_residual->element_count()) != n || head < 0 || head > n ||
      static_cast<int64_t>(dense_momentum.element_count()) != n - head ||
      static_cast<int64_t>(sent.element_count()) * 32 < n) {
    return ffi::Error::InvalidArgument(
        "the residual, the momentum and both outputs must be as long as the leaves, the head"
        " within them, the dense momentum as long as the rest and the mask cover them all");
  }
  const uint32_t* bits = sent.typed_data();
  const float* tail = dense_momentum.typed_data();
  float* e_out = new_residual->typed_data();
  float* u_out = new_momentum->typed_data();
  // Read before written at each position: the outputs may be the inputs (aliased).
  return Guarded("jaxcomp_momentum_masked", [&] {
    InHalves(n, n, [&](int64_t first, int64_t last) {
      OverLeaves(in.leaves, in.offsets, first, last,
                 [&](const float* g, int64_t i, int64_t count) {
        const float* u = in.momentum;
        const float* e = in.residual;
        const int64_t sparse = std::clamp<int64_t>(head - i, 0, count);
        auto was_sent = [&](int64_t at) { return (bits[at >> 5] >> (at & 31)) & 1u; };
        auto masked = [&](bool nesterov_form) {
          for (int64_t j = 0; j < sparse; ++j) {
            const int64_t at = i + j;
            const float next = NextMomentum(coefficient, u[at], g[j], nesterov_form);
            const float kept = Corrected(next, g[j], e[at], nesterov_form);
            const bool zero = was_sent(at);
            u_out[at] = zero ? 0.0f : next;
            e_out[at] = zero ? 0.0f : kept;
          }
        };
        if (in.nesterov) {
          masked(true);
        } else {
          masked(false);
        }
        for (int64_t j = sparse; j < count; ++j) {
          const int64_t at = i + j;
          const float kept = g[j] + e[at];
          u_out[at] = tail[at - head];
          e_out[at] = was_sent(at) ? 0.0f : kept;
        }
      });
    });
  });
}

// ------------------------------------------------------------------- low rank

// A method's run of `count` matrices of one shape, each rows x cols, row-major,
// end to end (jaxcomp/_src/lowrank.py's MatrixView.groups).
struct Group {
  int64_t count, rows, cols;
};

// The groups of a flat (count, rows, cols) attribute, or none where it is not whole
// triples of positive sizes.
std::vector<Group> Groups(ffi::Span<const int64_t> flat) {
  std::vector<Group> groups;
  if (flat.size() % 3 != 0) return {};
  for (size_t g = 0; g < flat.size(); g += 3) {
    if (flat[g] < 1 || flat[g + 1] < 1 || flat[g + 2] < 1) return {};
    groups.push_back({flat[g], flat[g + 1], flat[g + 2]});
  }
  return groups;
}

// One compressed leaf: its matrix (the corrected gradient `m`, or with `e` the
// gradient to which the residual `e` is added), its shape, and where its factor lies in
// the factor buffer read (`in`) and in the one written (`out`).
struct Leaf {
  const float* m;
  int64_t rows, cols, in, out;
  const float* e = nullptr;

  // Entries [from, to) of row i of M: `m`'s own, or with `e` their sum with the
  // residual's, formed in `scratch` (at least to - from entries).
  const float* Row(int64_t i, int64_t from, int64_t to, float* scratch) const {
    const float* g = m + i * cols + from;
    if (e == nullptr) return g;
    const float* residual = e + i * cols + from;
    for (int64_t k = 0; k < to - from; ++k) scratch[k] = g[k] + residual[k];
    return scratch;
  }
};

// Every matrix of a method's runs, in order, into `leaves` (their offsets left 0 for
// the caller), or an error where the runs do not fit the groups: one run per group,
// its matrices end to end, or with `apart` one run per matrix (the leaves as they
// lie). With `residual` (at least the matrices' entries, laid out as they are), each
// matrix's M is its run plus its span of it.
ffi::Error RunMatrices(ffi::Span<const int64_t> groups_attr, ffi::RemainingArgs& runs, int64_t r,
                       bool apart, const float* residual, std::vector<Leaf>* leaves) {
  const std::vector<Group> groups = Groups(groups_attr);
  size_t matrices = 0;
  for (const Group& group : groups) matrices += group.count;
  if (groups.empty() || (apart ? matrices : groups.size()) != runs.size() || r < 1) {
    return ffi::Error::InvalidArgument(
        "one run per group (per matrix where apart) of positive sizes, and rank >= 1");
  }
  int64_t at = 0, offset = 0;
  for (const Group& group : groups) {
    const int64_t size = group.rows * group.cols;
    for (int64_t c = 0; c < group.count; ++c) {
      auto run = runs.get<ffi::Buffer<ffi::F32>>(apart ? at + c : at);
      if (!run.has_value()) return run.error();
      if (static_cast<int64_t>(run->element_count()) != (apart ? 1 : group.count) * size) {
        return ffi::Error::InvalidArgument("each run must hold its group's matrices");
      }
      leaves->push_back({run->typed_data() + (apart ? 0 : c * size), group.rows, group.cols, 0,
                         0, residual == nullptr ? nullptr : residual + offset});
      offset += size;
    }
    at += apart ? group.count : 1;
  }
  return ffi::Error::Success();
}

// Rows [first, last) of a leaf's M (? x cols) times the r columns of a factor given as
// r rows of cols entries (`columns`), into out (rows x r, row-major). Column by column
// over the row (in cache), so that the sums stay in registers.
JAXCOMP_WIDE void LeftRows(const Leaf& leaf, const float* columns, int64_t r, int64_t first,
                           int64_t last, float* out) {
  const int64_t cols = leaf.cols;
  const int64_t whole = cols - cols % kLanes;
  std::vector<float> scratch(leaf.e == nullptr ? 0 : cols);
  for (int64_t i = first; i < last; ++i) {
    const float* row = leaf.Row(i, 0, cols, scratch.data());
    for (int64_t j = 0; j < r; ++j) {
      const float* column = columns + j * cols;
      float lane[kLanes] = {};
      for (int64_t k = 0; k < whole; k += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) lane[l] += row[k + l] * column[k + l];
      }
      float tail = 0.0f;
      for (int64_t k = whole; k < cols; ++k) tail += row[k] * column[k];
      out[i * r + j] = Joined(lane) + tail;
    }
  }
}

// Columns [first, last) of M^T f (a leaf's M rows x cols, f rows x r, row-major) into
// out (cols x r); each entry summed over the rows in order.
JAXCOMP_WIDE void RightColumns(const Leaf& leaf, const float* f, int64_t r, int64_t first,
                               int64_t last, float* out) {
  const int64_t width = last - first;
  std::vector<float> sums(r * width, 0.0f);
  std::vector<float> scratch(leaf.e == nullptr ? 0 : width);
  for (int64_t i = 0; i < leaf.rows; ++i) {
    const float* row = leaf.Row(i, first, last, scratch.data());
    for (int64_t j = 0; j < r; ++j) {
      float* sum = &sums[j * width];
      const float p = f[i * r + j];
      for (int64_t k = 0; k < width; ++k) sum[k] += row[k] * p;
    }
  }
  for (int64_t k = 0; k < width; ++k) {
    for (int64_t j = 0; j < r; ++j) out[(first + k) * r + j] = sums[j * width + k];
  }
}

// Runs `body(0, count)` here, or, where the work covers at least kSplitAbove entries,
// `body(0, cut)` here and `body(cut, count)` on a second thread, `cut` the unit where
// half of `costs` (one per unit) is reached.
template <typename Body>
void InHalvesByCost(const std::vector<int64_t>& costs, Body body) {
  const int64_t count = static_cast<int64_t>(costs.size());
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  int64_t reached = 0, cut = 0;
  while (cut < count && 2 * reached < total) reached += costs[cut++];
  if (total < kSplitAbove || cut <= 0 || cut >= count) {
    body(0, count);
  } else {
    InParallel([&] { body(0, cut); }, [&] { body(cut, count); });
  }
}

// Where each leaf's units (`units(leaf)` of them: its rows, or its columns) start when
// the leaves' are laid end to end, then their count; and each unit's cost, `cost(leaf)`.
template <typename Units, typename Cost>
std::vector<int64_t> UnitStarts(const std::vector<Leaf>& leaves, Units units, Cost cost,
                                std::vector<int64_t>* costs) {
  std::vector<int64_t> starts = {0};
  for (const Leaf& leaf : leaves) {
    starts.push_back(starts.back() + units(leaf));
    costs->insert(costs->end(), units(leaf), cost(leaf));
  }
  return starts;
}

// Each leaf's factor (n x r, row-major, at `f`) as r rows of its n columns' entries.
void AsRows(const float* f, int64_t n, int64_t r, float* rows) {
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t j = 0; j < r; ++j) rows[j * n + k] = f[k * r + j];
  }
}

ffi::Error LowrankProductImpl(ffi::Buffer<ffi::F32> factor, ffi::Buffer<ffi::F32> dense,
                              ffi::Buffer<ffi::F32> residual, ffi::RemainingArgs runs,
                              ffi::Span<const int64_t> groups_attr, ffi::Span<const float> scales,
                              int64_t r, int64_t transposed, int64_t unit,
                              ffi::ResultBuffer<ffi::F32> out) {
  // With a residual, the runs are the leaves, each corrected by its span of it (read
  // only once the sizes are checked).
  const int64_t given = static_cast<int64_t>(residual.element_count());
  std::vector<Leaf> leaves;
  if (ffi::Error error = RunMatrices(groups_attr, runs, r, given > 0,
                                     given > 0 ? residual.typed_data() : nullptr, &leaves);
      error.failure()) {
    return error;
  }
  int64_t in_size = 0, out_size = 0, entries = 0;
  for (Leaf& leaf : leaves) {
    leaf.in = in_size;
    leaf.out = out_size;
    in_size += (transposed ? leaf.rows : leaf.cols) * r;
    out_size += (transposed ? leaf.cols : leaf.rows) * r;
    entries += leaf.rows * leaf.cols;
  }
  const int64_t count = static_cast<int64_t>(leaves.size());
  const int64_t dense_size = static_cast<int64_t>(dense.element_count());
  if (static_cast<int64_t>(factor.element_count()) != in_size ||
      static_cast<int64_t>(scales.size()) != count ||
      static_cast<int64_t>(out->element_count()) != out_size + dense_size ||
      (given > 0 && given < entries)) {
    return ffi::Error::InvalidArgument(
        "the factor, the scales (one per matrix), the output (the products, then the dense"
        " entries) and the residual (none, or at least the matrices' entries) must fit the"
        " groups");
  }
  const float* f = factor.typed_data();
  float* result = out->typed_data();
  return Guarded("jaxcomp_lowrank_product", [&] {
    // The factor times its column scales: with `unit`, unit_factor of the column's
    // largest magnitude, then its matrix's scale (the JAX route's two products, in order).
    std::vector<float> scaled(f, f + in_size);
    for (int64_t a = 0; a < count; ++a) {
      const int64_t n = transposed ? leaves[a].rows : leaves[a].cols;
      float* column = scaled.data() + leaves[a].in;
      for (int64_t j = 0; j < r; ++j) {
        if (unit) {
          int32_t top = 0;
          for (int64_t k = 0; k < n; ++k) {
            int32_t bits;
            std::memcpy(&bits, column + k * r + j, sizeof(bits));
            top = std::max(top, bits & 0x7FFFFFFF);
          }
          const float factor_of_column = UnitFactor(top);
          for (int64_t k = 0; k < n; ++k) column[k * r + j] *= factor_of_column;
        }
        for (int64_t k = 0; k < n; ++k) column[k * r + j] *= scales[a];
      }
    }
    std::vector<int64_t> costs;
    const auto rows = [](const Leaf& leaf) { return leaf.rows; };
    const auto cols = [](const Leaf& leaf) { return leaf.cols; };
    if (!transposed) {
      // Each leaf's factor as r rows of its columns' entries; the matrices' rows in two
      // halves of about equal work.
      std::vector<float> columns(in_size);
      for (const Leaf& leaf : leaves) {
        AsRows(scaled.data() + leaf.in, leaf.cols, r, columns.data() + leaf.in);
      }
      const std::vector<int64_t> starts = UnitStarts(leaves, rows, cols, &costs);
      InHalvesByCost(costs, [&](int64_t begin, int64_t end) {
        OverParts(starts, leaves.size(), begin, end, [&](size_t a, int64_t from, int64_t to) {
          const Leaf& leaf = leaves[a];
          LeftRows(leaf, columns.data() + leaf.in, r, from - starts[a], to - starts[a],
                   result + leaf.out);
        });
      });
    } else {
      // The matrices' columns in two halves of about equal work.
      const std::vector<int64_t> starts = UnitStarts(leaves, cols, rows, &costs);
      InHalvesByCost(costs, [&](int64_t begin, int64_t end) {
        OverParts(starts, leaves.size(), begin, end, [&](size_t a, int64_t from, int64_t to) {
          const Leaf& leaf = leaves[a];
          RightColumns(leaf, scaled.data() + leaf.in, r, from - starts[a], to - starts[a],
                       result + leaf.out);
        });
      });
    }
    if (dense_size > 0) std::memcpy(result + out_size, dense.typed_data(), dense_size * sizeof(float));
  });
}

// Each leaf's factor (n x r, row-major, the leaves' n in `lengths`) column by column:
// with `scales` (one per leaf), the column times its leaf's scale where every entry
// of that product is finite, else as it is; with `old` (as long as the factor), a
// column that is then all zero replaced by old's; with `orthonormalize`, modified
// Gram-Schmidt in double: column i loses its projections on the columns before it,
// then is scaled to norm 1 (a column that is then exactly zero stays zero; NaN stays
// NaN). A double holds every f32 entry squared, so no column needs rescaling, and one
// fixed order of sums gives the same result on every device.
ffi::Error FactorColumnsImpl(ffi::Buffer<ffi::F32> factor, ffi::Buffer<ffi::F32> old,
                             ffi::Span<const int64_t> lengths, ffi::Span<const float> scales,
                             int64_t r, int64_t orthonormalize, ffi::ResultBuffer<ffi::F32> out) {
  int64_t size = 0;
  for (int64_t n : lengths) {
    if (n < 1) return ffi::Error::InvalidArgument("every length must be positive");
    size += n * r;
  }
  const int64_t given = static_cast<int64_t>(old.element_count());
  const int64_t scaled = static_cast<int64_t>(scales.size());
  if (r < 1 || static_cast<int64_t>(factor.element_count()) != size ||
      static_cast<int64_t>(out->element_count()) != size || (given != 0 && given != size) ||
      (scaled != 0 && scaled != static_cast<int64_t>(lengths.size()))) {
    return ffi::Error::InvalidArgument(
        "the factor, the output and `old` (or nothing) must hold sum(lengths) x rank entries,"
        " and `scales` one per length (or nothing)");
  }
  const float* f = factor.typed_data();
  const float* refill = given == 0 ? nullptr : old.typed_data();
  const float* scale = scaled == 0 ? nullptr : scales.begin();
  float* result = out->typed_data();
  return Guarded("jaxcomp_factor_columns", [&] {
    std::vector<float> entries;
    std::vector<double> columns;
    int64_t offset = 0;
    for (size_t a = 0; a < lengths.size(); ++a) {
      const int64_t n = lengths[a];
      columns.assign(r * n, 0.0);
      entries.resize(n);
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t k = 0; k < n; ++k) entries[k] = f[offset + k * r + j];
        if (scale != nullptr) {
          bool finite = true;
          for (int64_t k = 0; k < n; ++k) finite = finite && std::isfinite(entries[k] * scale[a]);
          if (finite) {
            for (int64_t k = 0; k < n; ++k) entries[k] *= scale[a];
          }
        }
        bool zero = true;
        for (int64_t k = 0; k < n; ++k) zero = zero && entries[k] == 0.0f;
        if (zero && refill != nullptr) {
          for (int64_t k = 0; k < n; ++k) entries[k] = refill[offset + k * r + j];
        }
        if (!orthonormalize) {
          for (int64_t k = 0; k < n; ++k) result[offset + k * r + j] = entries[k];
          continue;
        }
        double* column = &columns[j * n];
        for (int64_t k = 0; k < n; ++k) column[k] = entries[k];
        for (int64_t i = 0; i < j; ++i) {
          const double* before = &columns[i * n];
          double dot = 0.0;
          for (int64_t k = 0; k < n; ++k) dot += before[k] * column[k];
          for (int64_t k = 0; k < n; ++k) column[k] -= dot * before[k];
        }
        double square = 0.0;
        for (int64_t k = 0; k < n; ++k) square += column[k] * column[k];
        const double norm = std::sqrt(square);
        const double divisor = norm == 0.0 ? 1.0 : norm;
        for (int64_t k = 0; k < n; ++k) column[k] /= divisor;
        for (int64_t k = 0; k < n; ++k) result[offset + k * r + j] = static_cast<float>(column[k]);
      }
      offset += n * r;
    }
  });
}

// One row of M - P Q^T: `written` = row - sum_j p[j] qt[j] (qt: Q as r rows of cols
// entries), the sum column 0's term plus each next one's in order, each over the
// whole row (in cache).
JAXCOMP_WIDE void ResidualRow(const float* row, const float* p, const float* qt, int64_t cols,
                              int64_t r, float* written) {
  for (int64_t k = 0; k < cols; ++k) written[k] = p[0] * qt[k];
  for (int64_t j = 1; j < r; ++j) {
    const float pj = p[j];
    const float* column = qt + j * cols;
    for (int64_t k = 0; k < cols; ++k) written[k] += pj * column[k];
  }
  for (int64_t k = 0; k < cols; ++k) written[k] = row[k] - written[k];
}

// Each leaf's M - P Q^T (P rows x r, Q cols x r, row-major, leaf after leaf) written
// over the first entries of `buffer` (the output, which XLA aliases with it) in the
// leaves' order; the entries after them stay. The product is summed as the JAX route
// writes it: P[i, 0] Q[k, 0], plus each next column's in order.
ffi::Error LowrankResidualImpl(ffi::Buffer<ffi::F32> buffer, ffi::Buffer<ffi::F32> p,
                               ffi::Buffer<ffi::F32> q, ffi::RemainingArgs runs,
                               ffi::Span<const int64_t> groups_attr, int64_t r,
                               int64_t from_leaves, ffi::ResultBuffer<ffi::F32> out) {
  // With `from_leaves`, the runs are the leaves and M is each plus the old residual
  // (the buffer's entries, read a row at a time before the row is written).
  float* result = out->typed_data();
  std::vector<Leaf> leaves;
  if (ffi::Error error = RunMatrices(groups_attr, runs, r, from_leaves != 0,
                                     from_leaves != 0 ? result : nullptr, &leaves);
      error.failure()) {
    return error;
  }
  std::vector<int64_t> q_offsets;
  int64_t p_size = 0, q_size = 0, size = 0;
  for (Leaf& leaf : leaves) {
    // `in`: where the leaf's P starts; `out`: where its residual does.
    leaf.in = p_size;
    leaf.out = size;
    q_offsets.push_back(q_size);
    p_size += leaf.rows * r;
    q_size += leaf.cols * r;
    size += leaf.rows * leaf.cols;
  }
  if (static_cast<int64_t>(p.element_count()) != p_size ||
      static_cast<int64_t>(q.element_count()) != q_size ||
      static_cast<int64_t>(buffer.element_count()) < size ||
      out->element_count() != buffer.element_count()) {
    return ffi::Error::InvalidArgument(
        "P, Q and the buffer (at least the matrices' entries, the output's size) must fit the"
        " groups");
  }
  const float* factor_p = p.typed_data();
  const float* factor_q = q.typed_data();
  return Guarded("jaxcomp_lowrank_residual", [&] {
    if (result != buffer.typed_data()) {
      std::memcpy(result, buffer.typed_data(), buffer.element_count() * sizeof(float));
    }
    // Each leaf's Q as r rows of its columns' entries; the matrices' rows in two halves
    // of about equal work.
    std::vector<float> columns(q_size);
    for (size_t a = 0; a < leaves.size(); ++a) {
      AsRows(factor_q + q_offsets[a], leaves[a].cols, r, columns.data() + q_offsets[a]);
    }
    std::vector<int64_t> costs;
    const std::vector<int64_t> starts = UnitStarts(
        leaves, [](const Leaf& leaf) { return leaf.rows; },
        [](const Leaf& leaf) { return leaf.cols; }, &costs);
    InHalvesByCost(costs, [&](int64_t begin, int64_t end) {
      OverParts(starts, leaves.size(), begin, end, [&](size_t a, int64_t from, int64_t to) {
        const Leaf& leaf = leaves[a];
        std::vector<float> scratch(leaf.e == nullptr ? 0 : leaf.cols);
        for (int64_t i = from - starts[a]; i < to - starts[a]; ++i) {
          ResidualRow(leaf.Row(i, 0, leaf.cols, scratch.data()), factor_p + leaf.in + i * r,
                      columns.data() + q_offsets[a], leaf.cols, r,
                      result + leaf.out + i * leaf.cols);
        }
      });
    });
  });
}

// ------------------------------------------------------------------- DeMo

// Chunks transformed at once: each row operation of the transform works on one entry
// of this many chunks, lane by lane.
constexpr int64_t kChunkLanes = 16;
constexpr double kPi = 3.14159265358979323846;
using Lanes = float[kChunkLanes];

// Lee's fast DCT-II (B. G. Lee, 1984), unnormalised, of the kChunkLanes chunks that are
// the columns of x (n rows, n a power of two): row k becomes
// sum_j x[j] cos(pi (j + 1/2) k / n). With h = n / 2: a[i] = x[i] + x[n - 1 - i] and
// b[i] = (x[i] - x[n - 1 - i]) f[i], f[i] = 1 / (2 cos(pi (i + 1/2) / n)) as f32
// (factors[h - 1 + i]), each transformed at size h; then row 2i is a[i], row 2i + 1 is
// b[i] + b[i + 1] (b[h - 1] for the last). n log2(n) / 2 products where the matrix
// takes n^2, in one fixed order on every machine. `scratch` holds n rows.
JAXCOMP_WIDE void LeeDct(Lanes* x, Lanes* scratch, int64_t n, const float* factors) {
  if (n == 1) return;
  const int64_t half = n / 2;
  Lanes* a = scratch;
  Lanes* b = scratch + half;
  const float* f = factors + (half - 1);
  for (int64_t i = 0; i < half; ++i) {
    const float* low = x[i];
    const float* high = x[n - 1 - i];
    for (int64_t l = 0; l < kChunkLanes; ++l) {
      a[i][l] = low[l] + high[l];
      b[i][l] = (low[l] - high[l]) * f[i];
    }
  }
  LeeDct(a, x, half, factors);
  LeeDct(b, x + half, half, factors);
  for (int64_t i = 0; i + 1 < half; ++i) {
    for (int64_t l = 0; l < kChunkLanes; ++l) {
      x[2 * i][l] = a[i][l];
      x[2 * i + 1][l] = b[i][l] + b[i + 1][l];
    }
  }
  for (int64_t l = 0; l < kChunkLanes; ++l) {
    x[n - 2][l] = a[half - 1][l];
    x[n - 1][l] = b[half - 1][l];
  }
}

// The kChunkLanes chunks of `chunk` entries laid end to end in `rows`, each one's DCT-II
// into a lane of x, coefficient j times scales[j]. Lee's sums grow past the chunk's
// largest magnitude (the first coefficient is the sum of the chunk, before its scale),
// so a chunk whose largest magnitude is 2 or more is brought below 2 by a power of two
// first and the coefficients taken back by its inverse (both exact): any finite chunk
// has finite coefficients, each at most its largest magnitude, and the bits are those
// of the unscaled sums wherever these neither overflow nor leave the normal floats.
JAXCOMP_WIDE void ChunkDcts(const float* rows, Lanes* x, Lanes* scratch, int64_t chunk,
                            const float* factors, const float* scales) {
  int32_t top[kChunkLanes] = {};
  for (int64_t j = 0; j < chunk; ++j) {
    for (int64_t l = 0; l < kChunkLanes; ++l) {
      x[j][l] = rows[l * chunk + j];
      top[l] = std::max(top[l], MagnitudeKey(x[j][l]));
    }
  }
  float down[kChunkLanes], up[kChunkLanes];
  for (int64_t l = 0; l < kChunkLanes; ++l) {
    down[l] = std::min(UnitFactor(top[l]), 1.0f);
    up[l] = 1.0f / down[l];
  }
  for (int64_t j = 0; j < chunk; ++j) {
    for (int64_t l = 0; l < kChunkLanes; ++l) x[j][l] = x[j][l] * down[l];
  }
  LeeDct(x, scratch, chunk, factors);
  for (int64_t j = 0; j < chunk; ++j) {
    for (int64_t l = 0; l < kChunkLanes; ++l) x[j][l] = (x[j][l] * scales[j]) * up[l];
  }
}

// Up to this many coefficients a chunk are picked lane by lane, one argmax over the
// rows each; more by each chunk's RowTopk.
constexpr int64_t kLaneArgmaxK = 8;

// Each of the first `count` lanes' k largest coefficients of x (chunk rows), largest
// first, the lower row first on a tie, as RowTopk picks them: k argmax passes over the
// rows' keys, each then setting the key it found below every other (-1).
JAXCOMP_WIDE void LaneTopk(const Lanes* x, int64_t chunk, int64_t k, int64_t count,
                           int32_t (*keys)[kChunkLanes], float* values, int32_t* positions) {
  for (int64_t j = 0; j < chunk; ++j) {
    for (int64_t l = 0; l < kChunkLanes; ++l) keys[j][l] = MagnitudeKey(x[j][l]);
  }
  for (int64_t t = 0; t < k; ++t) {
    int32_t best[kChunkLanes], at[kChunkLanes];
    for (int64_t l = 0; l < kChunkLanes; ++l) {
      best[l] = -1;
      at[l] = 0;
    }
    for (int64_t j = 0; j < chunk; ++j) {
      for (int64_t l = 0; l < kChunkLanes; ++l) {
        const bool above = keys[j][l] > best[l];
        best[l] = above ? keys[j][l] : best[l];
        at[l] = above ? static_cast<int32_t>(j) : at[l];
      }
    }
    for (int64_t l = 0; l < count; ++l) {
      values[l * k + t] = x[at[l]][l];
      positions[l * k + t] = at[l];
      keys[at[l]][l] = -1;
    }
  }
}

// The leaves, the residual and the chunking of a DeMo call.
struct ChunkInputs {
  std::vector<const float*> leaves;
  std::vector<int64_t> offsets;
  const float* residual;
  int64_t chunk;

  int64_t n() const { return offsets.back(); }
  int64_t chunks() const { return (n() + chunk - 1) / chunk; }

  // Chunks [first, first + count) of the corrected gradient (zeros past n) into `out`.
  void Corrected(int64_t first, int64_t count, float* out) const {
    CorrectedSpan(leaves, offsets, residual, out, first * chunk, first * chunk,
                  (first + count) * chunk);
  }
};

// Whether `chunk` is a power of two in [1, 2^16].
bool PowerOfTwo(int64_t chunk) {
  return chunk >= 1 && chunk <= 65536 && (chunk & (chunk - 1)) == 0;
}

ffi::Error DctTopkImpl(ffi::Buffer<ffi::F32> residual, ffi::RemainingArgs leaves,
                       int64_t chunk, ffi::ResultBuffer<ffi::F32> values,
                       ffi::ResultBuffer<ffi::S32> positions) {
  ChunkInputs in{{}, {}, residual.typed_data(), chunk};
  if (ffi::Error error = LeafData(leaves, &in.leaves, &in.offsets); error.failure()) return error;
  const auto out_dims = values->dimensions();
  if (!PowerOfTwo(chunk) || static_cast<int64_t>(residual.element_count()) != in.n() ||
      in.n() < 1 || out_dims.size() != 2 || out_dims[0] != in.chunks() || out_dims[1] < 1 ||
      out_dims[1] > chunk || positions->element_count() != values->element_count()) {
    return ffi::Error::InvalidArgument(
        "the chunk must be a power of two, the residual as long as the leaves (at least one"
        " entry), and the outputs [chunks, k], k in [1, chunk]");
  }
  const int64_t k = out_dims[1];
  // f[i] of each size m = 2, 4, ..., chunk from factors[m / 2 - 1], and the orthonormal
  // DCT's factors over sqrt(chunk) (DeMo's scaled transform), rounded once from double.
  std::vector<float> factors(chunk), scales(chunk);
  for (int64_t m = 2; m <= chunk; m *= 2) {
    for (int64_t i = 0; i < m / 2; ++i) {
      factors[m / 2 - 1 + i] = static_cast<float>(0.5 / std::cos(kPi * (i + 0.5) / m));
    }
  }
  for (int64_t j = 0; j < chunk; ++j) {
    scales[j] = static_cast<float>((j == 0 ? 1.0 : std::sqrt(2.0)) / chunk);
  }
  float* out_values = values->typed_data();
  int32_t* out_positions = positions->typed_data();
  return Guarded("jaxcomp_dct_topk", [&] {
    InHalves(in.chunks(), in.n(), [&](int64_t first, int64_t last) {
      // Rows of kChunkLanes lanes, in flat buffers (a vector of arrays is not portable).
      std::vector<float> rows(kChunkLanes * chunk), lanes(2 * kChunkLanes * chunk);
      Lanes* x = reinterpret_cast<Lanes*>(lanes.data());
      Lanes* scratch = x + chunk;
      std::vector<int32_t> lane_keys(k <= kLaneArgmaxK ? kChunkLanes * chunk : 0), keys(k);
      for (int64_t c = first; c < last; c += kChunkLanes) {
        const int64_t count = std::min(kChunkLanes, last - c);
        in.Corrected(c, count, rows.data());
        std::fill(rows.begin() + count * chunk, rows.end(), 0.0f);
        ChunkDcts(rows.data(), x, scratch, chunk, factors.data(), scales.data());
        if (k <= kLaneArgmaxK) {
          LaneTopk(x, chunk, k, count,
                   reinterpret_cast<int32_t(*)[kChunkLanes]>(lane_keys.data()),
                   out_values + c * k, out_positions + c * k);
          continue;
        }
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t i = 0; i < chunk; ++i) rows[j * chunk + i] = x[i][j];
          RowTopk(rows.data() + j * chunk, chunk, k, out_values + (c + j) * k,
                  out_positions + (c + j) * k, keys.data());
        }
      }
    });
  });
}

// One chunk's residual: out[i] = decay (corrected[i] - sent[i]) for i < count, sent the
// sum of the chunk's k coefficients times their rows of `inverse` (chunk x chunk), the
// first term plus each next one's in order, each over the whole chunk.
JAXCOMP_WIDE void ChunkResidual(const float* corrected, const float* values,
                                const int32_t* positions, int64_t k, const float* inverse,
                                int64_t chunk, float decay, int64_t count, float* sent,
                                float* out) {
  auto row = [&](int64_t j) {
    return inverse + std::clamp<int64_t>(positions[j], 0, chunk - 1) * chunk;
  };
  const float* first = row(0);
  for (int64_t i = 0; i < chunk; ++i) sent[i] = values[0] * first[i];
  for (int64_t j = 1; j < k; ++j) {
    const float v = values[j];
    const float* next = row(j);
    for (int64_t i = 0; i < chunk; ++i) sent[i] = sent[i] + v * next[i];
  }
  for (int64_t i = 0; i < count; ++i) out[i] = decay * (corrected[i] - sent[i]);
}

ffi::Error DctResidualImpl(ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inverse,
                           ffi::RemainingArgs leaves, float decay,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = inverse.dimensions();
  const int64_t chunk = dims.size() == 2 ? dims[0] : 0;
  ChunkInputs in{{}, {}, residual.typed_data(), chunk};
  if (ffi::Error error = LeafData(leaves, &in.leaves, &in.offsets); error.failure()) return error;
  const auto value_dims = values.dimensions();
  const int64_t n = in.n();
  if (chunk < 1 || dims[1] != chunk || static_cast<int64_t>(residual.element_count()) != n ||
      static_cast<int64_t>(out->element_count()) != n || n < 1 || value_dims.size() != 2 ||
      value_dims[0] != in.chunks() || value_dims[1] < 1 ||
      positions.element_count() != values.element_count()) {
    return ffi::Error::InvalidArgument(
        "the inverse must be [chunk, chunk], the residual and the output as long as the"
        " leaves (at least one entry), and the coefficients and positions [chunks, k]");
  }
  const int64_t k = value_dims[1];
  const float* coefficients = values.typed_data();
  const int32_t* places = positions.typed_data();
  const float* rows = inverse.typed_data();
  float* result = out->typed_data();
  // Chunks formed at a time, about kChunk entries, each read before it is written (the
  // output may be the residual, aliased).
  const int64_t tile = std::max<int64_t>(1, kChunk / chunk);
  return Guarded("jaxcomp_dct_residual", [&] {
    InHalves(in.chunks(), n, [&](int64_t first, int64_t last) {
      std::vector<float> corrected(tile * chunk), sent(chunk);
      for (int64_t c = first; c < last; c += tile) {
        const int64_t count = std::min(tile, last - c);
        in.Corrected(c, count, corrected.data());
        for (int64_t j = 0; j < count; ++j) {
          const int64_t start = (c + j) * chunk;
          ChunkResidual(corrected.data() + j * chunk, coefficients + (c + j) * k,
                        places + (c + j) * k, k, rows, chunk, decay,
                        std::min(chunk, n - start), sent.data(), result + start);
        }
      }
    });
  });
}

// ------------------------------------------------------------------- integer codes

// Blocks [first, last) of `block` entries of the leaves plus the residual (where given)
// end to end, then zeros, a tile of about 4,096 entries at a time formed in cache
// (CorrectedSpan's sums, nothing of n entries written): `each(c, entries, count)` for
// each block c, `count` of its entries (the block, or its part before `limit`). The
// residual may be what `each` writes over: a tile is formed before any of it is.
template <typename Each>
void OverCorrectedBlocks(const std::vector<const float*>& leaves,
                         const std::vector<int64_t>& offsets, const float* residual,
                         int64_t block, int64_t first, int64_t last, int64_t limit, Each each) {
  const int64_t per_tile = std::max<int64_t>(1, 4096 / block);
  std::vector<float> tile(per_tile * block);
  for (int64_t b = first; b < last; b += per_tile) {
    const int64_t begin = b * block;
    const int64_t end = std::min(limit, std::min(last, b + per_tile) * block);
    if (begin >= end) break;
    CorrectedSpan(leaves, offsets, residual, tile.data(), begin, begin, end);
    for (int64_t c = b; c * block < end; ++c) {
      each(c, tile.data() + (c - b) * block, std::min(block, end - c * block));
    }
  }
}

// The integer codes' largest level, 2^(bits - 1) - 1: 127 for 8 bits, 7 for 4.
inline float IntegerTop(int64_t bits) { return bits == 8 ? 127.0f : 7.0f; }

// Error feedback's residual written block by block over `result` (the output, which
// XLA aliases with `old`, the old residual of the n entries: copied first where it does
// not): the leaves plus the old residual formed a tile at a time (OverCorrectedBlocks),
// then `each(c, x, count, written)` writes block c's `count` entries from x's.
template <typename Each>
void ResidualBlocks(const std::vector<const float*>& leaves, const std::vector<int64_t>& offsets,
                    const float* old, float* result, int64_t block, Each each) {
  const int64_t n = offsets.back();
  if (result != old) std::memcpy(result, old, n * sizeof(float));
  InHalves((n + block - 1) / block, n, [&](int64_t first, int64_t last) {
    OverCorrectedBlocks(leaves, offsets, result, block, first, last, n,
                        [&](int64_t c, const float* x, int64_t count) {
                          each(c, x, count, result + c * block);
                        });
  });
}

// jaxcomp/_src/quantized.py's level of x in a block whose scale s has the f32 inverse
// `inverse` = 1 / s (s = 0 taken as 1), as XLA:CPU divides by s: the nearest integer
// of x times it (ties to even), clipped to [-top, top] (top: 127 or 7); NaN as 0, as
// XLA:CPU converts it (its block's scale is inf: every entry decodes non-finite); a
// zero without its sign, as the int8 it is sent as (+ 0: -0 + 0 is +0).
inline float IntegerLevel(float x, float inverse, float top) {
  const float level = std::nearbyint(x * inverse);
  return level != level ? 0.0f : std::min(top, std::max(-top, level)) + 0.0f;
}

// One block of the integer codes (`count` entries at x): its scale, its largest
// magnitude (NaN as inf) times the f32 reciprocal of `top`, as XLA:CPU takes
// jaxcomp/_src/quantized.py's division by the constant; and its levels as bytes at
// `bytes`: 8 bits one int8 each, 4 bits two a byte (l + 8, the first in the low nibble).
JAXCOMP_WIDE float IntegerBlock(const float* x, int64_t count, int64_t bits, uint8_t* bytes) {
  const float top = IntegerTop(bits);
  const int32_t largest = LargestKey(x, count);
  float magnitude;
  std::memcpy(&magnitude, &largest, sizeof(magnitude));
  const float scale = magnitude * (1.0f / top);
  const float inverse = 1.0f / Divisor(scale);
  if (bits == 8) {
    for (int64_t j = 0; j < count; ++j) {
      bytes[j] = static_cast<uint8_t>(static_cast<int8_t>(IntegerLevel(x[j], inverse, top)));
    }
  } else {
    for (int64_t j = 0; j < count / 2; ++j) {
      const int32_t low = static_cast<int32_t>(IntegerLevel(x[2 * j], inverse, top)) + 8;
      const int32_t high = static_cast<int32_t>(IntegerLevel(x[2 * j + 1], inverse, top)) + 8;
      bytes[j] = static_cast<uint8_t>(low | (high << 4));
    }
  }
  return scale;
}

// c - s l of `count` entries at x (the corrected gradient) of a block of scale s
// (IntegerBlock's levels), at `written`: two roundings.
JAXCOMP_WIDE void IntegerResidualBlock(const float* x, int64_t count, float scale, float top,
                                       float* written) {
  const float inverse = 1.0f / Divisor(scale);
  for (int64_t j = 0; j < count; ++j) written[j] = x[j] - scale * IntegerLevel(x[j], inverse, top);
}

// The integer codes' first encoding (IntegerBlock's) of the leaves plus the residual
// end to end, then zeros, a few blocks at a time in cache.
ffi::Error IntegerEncodeImpl(ffi::Buffer<ffi::F32> residual, ffi::RemainingArgs leaves,
                             int64_t block, int64_t bits, ffi::ResultBuffer<ffi::U8> payload,
                             ffi::ResultBuffer<ffi::F32> scales) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  const int64_t count = static_cast<int64_t>(scales->element_count());
  const int64_t given = static_cast<int64_t>(residual.element_count());
  if ((bits != 8 && bits != 4) || block < 1 || (bits == 4 && block % 2 != 0) ||
      count * block < offsets.back() || (given != 0 && given != offsets.back()) ||
      static_cast<int64_t>(payload->element_count()) != count * block * bits / 8) {
    return ffi::Error::InvalidArgument(
        "8 or 4 bits (an even block for 4), the blocks holding the leaves, the residual as"
        " long as they are or empty, and the payload's bytes of the blocks");
  }
  const float* add = given == 0 ? nullptr : residual.typed_data();
  return Guarded("jaxcomp_integer_encode", [&] {
    InHalves(count, count * block, [&](int64_t first, int64_t last) {
      OverCorrectedBlocks(data, offsets, add, block, first, last, last * block,
                          [&](int64_t c, const float* x, int64_t entries) {
                            scales->typed_data()[c] = IntegerBlock(
                                x, entries, bits, payload->typed_data() + c * block * bits / 8);
                          });
    });
  });
}

// Error feedback's residual of the integer codes once the step is kept: each entry of
// the leaves plus the old residual (the buffer) less its level times its block's scale
// (IntegerResidualBlock), over the buffer in place.
ffi::Error IntegerResidualImpl(ffi::Buffer<ffi::F32> buffer, ffi::Buffer<ffi::F32> scales,
                               ffi::RemainingArgs leaves, int64_t block, int64_t bits,
                               ffi::ResultBuffer<ffi::F32> out) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  const int64_t n = offsets.back();
  const int64_t count = static_cast<int64_t>(scales.element_count());
  if ((bits != 8 && bits != 4) || block < 1 || count * block < n ||
      static_cast<int64_t>(buffer.element_count()) != n || out->element_count() != n) {
    return ffi::Error::InvalidArgument(
        "8 or 4 bits, the buffer (the output) as long as the leaves, and the scales' blocks"
        " holding them");
  }
  return Guarded("jaxcomp_integer_residual", [&] {
    ResidualBlocks(data, offsets, buffer.typed_data(), out->typed_data(), block,
                   [&](int64_t c, const float* x, int64_t count, float* written) {
                     IntegerResidualBlock(x, count, scales.typed_data()[c], IntegerTop(bits),
                                          written);
                   });
  });
}

// ------------------------------------------------------------------- QSGD

// lowbias32 (jaxcomp/_src/draws.py's _mix).
inline uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// QSGD's levels (jaxcomp/_src/qsgd.py's quantize, the same bits) of blocks [first, last)
// of x, `block` entries each, into `out`: with d the block's divisor (its norm, 1 for
// 0), u its unit factor and v its inverse, s = levels ((|x| u) v), rounded up from
// floor(s) where the entry's draw (draws.py's uniform of the words w0, w1 at its
// position) is below s - floor(s), at most `levels`, signed like x.
// `x` holds the blocks from `x_first` on (0: all of them).
JAXCOMP_WIDE void QsgdLevels(const float* x, const float* norms, const float* inverses,
                             int64_t block, int64_t first, int64_t last, float levels,
                             uint32_t w0, uint32_t w1, uint8_t* out, int64_t x_first = 0) {
  for (int64_t b = first; b < last; ++b) {
    const float divisor = Divisor(norms[b]);
    const float unit = UnitFactor(MagnitudeKey(divisor));
    const float inverse = inverses[b];
    const int64_t start = b * block;
    const float* entries = x + (b - x_first) * block;
    // Branch-free, so that the loop is vectorized: the level is in [-levels, levels]
    // or NaN (a block that is not finite), which converts to 0 as XLA converts it.
    for (int64_t j = 0; j < block; ++j) {
      const float value = entries[j];
      const float scaled = levels * ((std::fabs(value) * unit) * inverse);
      const float floor = std::floor(scaled);
      const uint32_t word = Mix(static_cast<uint32_t>(start + j) ^ w0) ^ w1;
      const float draw = static_cast<float>(static_cast<int32_t>(word >> 8)) * 0x1p-24f;
      const float up = floor + (draw < scaled - floor ? 1.0f : 0.0f);
      const float level = levels < up ? levels : up;
      const float sign = value > 0.0f ? 1.0f : value < 0.0f ? -1.0f : value;
      const float signed_level = level * sign;
      out[start + j] = static_cast<uint8_t>(static_cast<int8_t>(
          static_cast<int32_t>(signed_level == signed_level ? signed_level : 0.0f)));
    }
  }
}

// Block b of QSGD's encoding, its `block` entries at x + (b - x_first) block: its plain
// norm (PlainNorms), that norm's inverse (NormInverse) and, where the norm is finite,
// its levels (QsgdLevels), while the block is in cache.
void QsgdBlock(const float* x, int64_t block, int64_t b, int64_t x_first, float levels,
               uint32_t w0, uint32_t w1, float* norms, float* inverses, uint8_t* out) {
  PlainNorms(x + (b - x_first) * block, block, 0, 1, norms + b);
  inverses[b] = NormInverse(norms[b]);
  if (std::isfinite(norms[b])) {
    QsgdLevels(x, norms, inverses, block, b, b + 1, levels, w0, w1, out, x_first);
  }
}

// Whether each of the m values is finite.
bool AllFinite(const float* values, int64_t m) {
  bool finite = true;
  for (int64_t b = 0; b < m; ++b) finite = finite && std::isfinite(values[b]);
  return finite;
}

// QSGD's encoding of the m blocks of x where some block's squares overflowed (its plain
// norm is not finite): every block's scaled norm instead (ScaledNorms:
// jaxcomp/_src/qsgd.py's _norms takes one route for all), each norm's inverse
// (NormInverse), and every block's levels after them.
void QsgdEncodeScaled(const float* x, int64_t block, int64_t m, float levels, uint32_t w0,
                      uint32_t w1, float* norms, float* inverses, uint8_t* out) {
  InHalves(m, m * block, [&](int64_t first, int64_t last) {
    ScaledNorms(x, block, first, last, norms);
  });
  for (int64_t b = 0; b < m; ++b) inverses[b] = NormInverse(norms[b]);
  InHalves(m, m * block, [&](int64_t first, int64_t last) {
    QsgdLevels(x, norms, inverses, block, first, last, levels, w0, w1, out);
  });
}

// QSGD's encoding of x (m blocks): each block's norm, inverse and levels in one pass
// (QsgdBlock); where any block's squares overflow, QsgdEncodeScaled.
void QsgdEncode(const float* x, int64_t block, int64_t m, float levels, uint32_t w0,
                uint32_t w1, float* norms, float* inverses, uint8_t* out) {
  InHalves(m, m * block, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      QsgdBlock(x, block, b, 0, levels, w0, w1, norms, inverses, out);
    }
  });
  if (!AllFinite(norms, m)) QsgdEncodeScaled(x, block, m, levels, w0, w1, norms, inverses, out);
}

// QsgdEncode of the leaves (plus the residual, where given) end to end, then zeros (m
// blocks), a few blocks at a time formed in a tile (OverCorrectedBlocks): nothing of n
// entries is written, where no block's squares overflow; where one does, the sum is
// formed whole for QsgdEncodeScaled.
void QsgdEncodeLeaves(const std::vector<const float*>& leaves, const std::vector<int64_t>& offsets,
                      const float* residual, int64_t block, int64_t m, float levels, uint32_t w0,
                      uint32_t w1, float* norms, float* inverses, uint8_t* out) {
  InHalves(m, m * block, [&](int64_t first, int64_t last) {
    OverCorrectedBlocks(leaves, offsets, residual, block, first, last, last * block,
                        [&](int64_t c, const float* x, int64_t) {
                          QsgdBlock(x, block, c, c, levels, w0, w1, norms, inverses, out);
                        });
  });
  if (AllFinite(norms, m)) return;
  std::vector<float> x(m * block);
  CorrectedSpan(leaves, offsets, residual, x.data(), 0, 0, m * block);
  QsgdEncodeScaled(x.data(), block, m, levels, w0, w1, norms, inverses, out);
}

ffi::Error QsgdEncodeLeavesImpl(ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::U32> words,
                                ffi::RemainingArgs leaves, int64_t block, float levels,
                                ffi::ResultBuffer<ffi::U8> out, ffi::ResultBuffer<ffi::F32> norms,
                                ffi::ResultBuffer<ffi::F32> inverses) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  const int64_t m = static_cast<int64_t>(norms->element_count());
  const int64_t given = static_cast<int64_t>(residual.element_count());
  if (block < 1 || m * block < offsets.back() || (given != 0 && given != offsets.back()) ||
      inverses->element_count() != norms->element_count() || words.element_count() != 2 ||
      static_cast<int64_t>(out->element_count()) != m * block) {
    return ffi::Error::InvalidArgument(
        "whole blocks of `block` >= 1 entries holding the leaves, the residual as long as"
        " they are or empty, one norm and one inverse a block, the words two and a level an"
        " entry");
  }
  const uint32_t w0 = words.typed_data()[0], w1 = words.typed_data()[1];
  const float* add = given == 0 ? nullptr : residual.typed_data();
  return Guarded("jaxcomp_qsgd_encode_leaves", [&] {
    QsgdEncodeLeaves(data, offsets, add, block, m, levels, w0, w1,
                     norms->typed_data(), inverses->typed_data(), out->typed_data());
  });
}

// QSGD's residual once the step is kept: each entry of the leaves plus the old residual
// (the buffer) less its level (int8, the payload) times its block's step (the norm over
// the levels, as the JAX route decodes it), over the buffer in place: two roundings.
JAXCOMP_WIDE void QsgdResidualBlock(const float* x, int64_t count, float step,
                                    const int8_t* levels, float* written) {
  for (int64_t j = 0; j < count; ++j) written[j] = x[j] - step * static_cast<float>(levels[j]);
}

ffi::Error QsgdResidualImpl(ffi::Buffer<ffi::F32> buffer, ffi::Buffer<ffi::U8> payload,
                            ffi::Buffer<ffi::F32> steps, ffi::RemainingArgs leaves, int64_t block,
                            ffi::ResultBuffer<ffi::F32> out) {
  std::vector<const float*> data;
  std::vector<int64_t> offsets;
  if (ffi::Error error = LeafData(leaves, &data, &offsets); error.failure()) return error;
  const int64_t n = offsets.back();
  const int64_t m = static_cast<int64_t>(steps.element_count());
  if (block < 1 || m * block < n || static_cast<int64_t>(payload.element_count()) < n ||
      static_cast<int64_t>(buffer.element_count()) != n || out->element_count() != n) {
    return ffi::Error::InvalidArgument(
        "the buffer (the output) as long as the leaves, a level for each of their entries"
        " and a step a block");
  }
  const int8_t* levels = reinterpret_cast<const int8_t*>(payload.typed_data());
  return Guarded("jaxcomp_qsgd_residual", [&] {
    ResidualBlocks(data, offsets, buffer.typed_data(), out->typed_data(), block,
                   [&](int64_t c, const float* x, int64_t count, float* written) {
                     QsgdResidualBlock(x, count, steps.typed_data()[c], levels + c * block,
                                       written);
                   });
  });
}

ffi::Error QsgdLevelsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norms,
                          ffi::Buffer<ffi::F32> inverses, ffi::Buffer<ffi::U32> words,
                          float levels, ffi::ResultBuffer<ffi::U8> out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t blocks = static_cast<int64_t>(norms.element_count());
  if (blocks < 1 || n % blocks != 0 || inverses.element_count() != norms.element_count() ||
      words.element_count() != 2 || static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "x must be whole blocks, one norm and one inverse each, the words two and the"
        " output as long as x");
  }
  const int64_t block = n / blocks;
  const uint32_t w0 = words.typed_data()[0], w1 = words.typed_data()[1];
  return Guarded("jaxcomp_qsgd_levels", [&] {
    InHalves(blocks, n, [&](int64_t first, int64_t last) {
      QsgdLevels(x.typed_data(), norms.typed_data(), inverses.typed_data(), block, first, last,
                 levels, w0, w1, out->typed_data());
    });
  });
}

ffi::Error QsgdEncodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> words, int64_t block,
                          float levels, ffi::ResultBuffer<ffi::U8> out,
                          ffi::ResultBuffer<ffi::F32> norms, ffi::ResultBuffer<ffi::F32> inverses) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (block < 1 || n % block != 0 || static_cast<int64_t>(norms->element_count()) != n / block ||
      inverses->element_count() != norms->element_count() || words.element_count() != 2 ||
      static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "x must be whole blocks of `block` >= 1 entries, one norm and one inverse each, the"
        " words two and the output as long as x");
  }
  const uint32_t w0 = words.typed_data()[0], w1 = words.typed_data()[1];
  return Guarded("jaxcomp_qsgd_encode", [&] {
    QsgdEncode(x.typed_data(), block, n / block, levels, w0, w1, norms->typed_data(),
               inverses->typed_data(), out->typed_data());
  });
}

// jaxcomp/_src/collectives.py's densify (the same bits), written as the leaves of a
// bucket: the outputs, end to end, are zeros, then each entry of `values` is added at
// its position in `indices` (one of [0, n), n the outputs' entries together; others
// are dropped), one after the other in order, as XLA:CPU's scatter adds them. The
// zeros on two threads where there are many. `after` orders the call after what
// wrote it, and is not read.
ffi::Error DensifyLeavesImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> indices,
                             ffi::Buffer<ffi::F32> after, ffi::RemainingRets leaves) {
  (void)after;
  if (values.element_count() != indices.element_count()) {
    return ffi::Error::InvalidArgument("one index per value");
  }
  std::vector<float*> out;
  std::vector<int64_t> starts = {0};
  for (size_t j = 0; j < leaves.size(); ++j) {
    auto leaf = leaves.get<ffi::Buffer<ffi::F32>>(j);
    if (!leaf.has_value()) return leaf.error();
    out.push_back((*leaf)->typed_data());
    starts.push_back(starts.back() + static_cast<int64_t>((*leaf)->element_count()));
  }
  const int64_t n = starts.back();
  const float* entries = values.typed_data();
  const int32_t* positions = indices.typed_data();
  const int64_t count = static_cast<int64_t>(values.element_count());
  return Guarded("jaxcomp_densify_leaves", [&] {
    InHalves(n, n, [&](int64_t begin, int64_t end) {
      OverParts(starts, out.size(), begin, end, [&](size_t j, int64_t from, int64_t to) {
        std::fill(out[j] + (from - starts[j]), out[j] + (to - starts[j]), 0.0f);
      });
    });
    for (int64_t i = 0; i < count; ++i) {
      const int64_t position = positions[i];
      if (position < 0 || position >= n) continue;
      const size_t leaf = static_cast<size_t>(
          std::upper_bound(starts.begin(), starts.end(), position) - starts.begin() - 1);
      out[leaf][position - starts[leaf]] += entries[i];
    }
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTopk, TopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int32_t>("empty_index")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSampledTopk, SampledTopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("candidates")
                                  .Attr<float>("min_fraction")
                                  .Attr<int32_t>("empty_index")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSentMask, SentMaskImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("sent_from")
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTopkPerRow, TopkPerRowImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTwoLevel, TwoLevelImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCorrected, CorrectedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMomentumCorrected, MomentumCorrectedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("head")
                                  .Attr<float>("coefficient")
                                  .Attr<int64_t>("nesterov")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMomentumSampledTopk, MomentumSampledTopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("size")
                                  .Attr<float>("coefficient")
                                  .Attr<int64_t>("nesterov")
                                  .Attr<int64_t>("candidates")
                                  .Attr<float>("min_fraction")
                                  .Attr<int32_t>("empty_index")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMomentumMasked, MomentumMaskedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("head")
                                  .Attr<float>("coefficient")
                                  .Attr<int64_t>("nesterov")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompLowrankProduct, LowrankProductImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<ffi::Span<const float>>("scales")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("unit")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompFactorColumns, FactorColumnsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("lengths")
                                  .Attr<ffi::Span<const float>>("scales")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("orthonormalize")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompLowrankResidual, LowrankResidualImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("from_leaves")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompDensifyLeaves, DensifyLeavesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompDctTopk, DctTopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("chunk")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompDctResidual, DctResidualImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<float>("decay")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdLevels, QsgdLevelsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<float>("levels")
                                  .Ret<ffi::Buffer<ffi::U8>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdEncode, QsgdEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<float>("levels")
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompIntegerEncode, IntegerEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompIntegerResidual, IntegerResidualImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdEncodeLeaves, QsgdEncodeLeavesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("block")
                                  .Attr<float>("levels")
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdResidual, QsgdResidualImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::F32>>());
