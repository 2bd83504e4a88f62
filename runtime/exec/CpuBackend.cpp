//===- CpuBackend.cpp - The CPU backend, and finding the CUDA one --------===//
#include "ops/OpRegistry.h"
#include "runtime/comm/Comm.h"
#include "runtime/core/Backend.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/cpu/OptimizerKernels.h"
#include "runtime/kernels/KernelBodies.h"
#include "support/Attributes.h"
#include "support/Parallel.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <dlfcn.h>
#include <vector>

using namespace llvm;

namespace pipec::rt {

namespace {

Error notOnHost(const cpu::Tensor &t) {
  return createStringError(inconvertibleErrorCode(),
                           "the CPU backend was handed a tensor on device %d (%s)", t.device(),
                           t.describe().c_str());
}

template <typename T> void addTo(T *dst, const T *src, int64_t n) {
  parallelFor(n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dst[i] += src[i];
  });
}

/// Elements per block of squaresOf() and update(): a block is one thread's
/// work, and its partial sum is added in block order, so the sum does not
/// depend on how many threads ran.
constexpr int64_t blockElements = int64_t(1) << 16;

/// The sum of (scale x)^2 over \p n elements, in double: each block on eight
/// accumulators (the loop vectorizes), the blocks' sums added in order.
template <typename T> double squaresOf(const T *data, int64_t n, double scale) {
  int64_t blocks = (n + blockElements - 1) / blockElements;
  std::vector<double> partial(blocks, 0.0);
  parallelFor(blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const T *p = data + b * blockElements;
      int64_t count = std::min(blockElements, n - b * blockElements);
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= count; i += 8)
        for (int j = 0; j < 8; ++j) {
          double g = static_cast<double>(p[i + j]) * scale;
          acc[j] += g * g;
        }
      for (; i < count; ++i) {
        double g = static_cast<double>(p[i]) * scale;
        acc[0] += g * g;
      }
      partial[b] =
          ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  });
  double total = 0;
  for (double s : partial)
    total += s;
  return total;
}

/// The CPU backend. It counts (BackendCounters) the calls that would be
/// those on a device: a node, sum, addition or update launches; a download,
/// a synchronize and a norm make the host wait (the latter two bring back a
/// result's bytes); every tensor it makes or uploads is an allocation.
class CpuBackend final : public Backend {
public:
  std::string name() const override { return "cpu"; }

  Expected<std::vector<cpu::Tensor>> run(const onnx::NodeProto &node, int64_t opset,
                                         ArrayRef<const cpu::Tensor *> inputs) override {
    for (const cpu::Tensor *t : inputs)
      if (t && !t->onHost())
        return notOnHost(*t);
    return launched(cpu::runOp(node, opset, inputs));
  }

  Expected<std::vector<cpu::Tensor>> run(const onnx::NodeProto &node, const OpDef *def,
                                         ParsedAttrs &attrs, int64_t opset,
                                         ArrayRef<const cpu::Tensor *> inputs) override {
    for (const cpu::Tensor *t : inputs)
      if (t && !t->onHost())
        return notOnHost(*t);
    return launched(cpu::runOp(node, opset, inputs, def, &attrs));
  }

  BackendCounters counters() const override { return counted; }

  Expected<bool> runInto(const onnx::NodeProto &node, int64_t opset,
                         ArrayRef<const cpu::Tensor *> inputs, cpu::Tensor &acc) override {
    (void)opset;
    if (!isOp(node, OpId::Gemm) || inputs.size() != 2 || !inputs[0] || !inputs[1])
      return false;
    const cpu::Tensor &a = *inputs[0], &b = *inputs[1];
    auto f32 = [](const cpu::Tensor &t) { return t.elemType() == cpu::DType::F32 && t.onHost(); };
    if (!f32(a) || !f32(b) || !f32(acc) || a.rank() != 2 || b.rank() != 2)
      return false;
    bool transA = attrInt(node, "transA", 0), transB = attrInt(node, "transB", 0);
    int64_t m = transA ? a.dim(1) : a.dim(0), k = transA ? a.dim(0) : a.dim(1);
    int64_t kb = transB ? b.dim(1) : b.dim(0), n = transB ? b.dim(0) : b.dim(1);
    if (k != kb || acc.numElements() != m * n)
      return false;
    cpu::gemm(transA, transB, m, n, k, attrFloat(node, "alpha", 1.0f), a.data<float>(), a.dim(1),
              b.data<float>(), b.dim(1), 1.0f, acc.data<float>(), n);
    ++counted.launches;
    return true;
  }

  Expected<cpu::Tensor> upload(const cpu::Tensor &host) override {
    ++counted.allocations;
    return host;
  }

  Expected<cpu::Tensor> download(const cpu::Tensor &tensor) override {
    if (!tensor.onHost())
      return notOnHost(tensor);
    ++counted.hostSyncs;
    counted.deviceToHostBytes += tensor.byteSize();
    return tensor;
  }

  /// One wait for all: what a device's batch of copies costs.
  Expected<std::vector<cpu::Tensor>> downloadAll(ArrayRef<const cpu::Tensor *> tensors) override {
    std::vector<cpu::Tensor> out;
    for (const cpu::Tensor *t : tensors) {
      if (!t->onHost())
        return notOnHost(*t);
      counted.deviceToHostBytes += t->byteSize();
      out.push_back(*t);
    }
    if (!tensors.empty())
      ++counted.hostSyncs;
    return out;
  }

  Expected<cpu::Tensor> zeros(DType type, ArrayRef<int64_t> shape) override {
    ++counted.allocations;
    return cpu::Tensor(type, shape.vec());
  }

  Expected<cpu::Tensor> sum(ArrayRef<const cpu::Tensor *> terms) override {
    if (terms.empty())
      return createStringError(inconvertibleErrorCode(), "a sum of no terms");
    ++counted.launches, ++counted.allocations;
    cpu::Tensor total = terms[0]->clone();
    for (const cpu::Tensor *t : terms.drop_front())
      if (Error err = add(total, *t))
        return err;
    return total;
  }

  Expected<double> sumOfSquares(ArrayRef<const cpu::Tensor *> tensors, double scale) override {
    ++counted.launches, ++counted.hostSyncs;
    counted.deviceToHostBytes += sizeof(double);
    double total = 0;
    for (const cpu::Tensor *t : tensors) {
      if (!t->onHost())
        return notOnHost(*t);
      if (t->elemType() == cpu::DType::F64)
        total += squaresOf(t->data<double>(), t->numElements(), scale);
      else if (t->elemType() == cpu::DType::F32)
        total += squaresOf(t->data<float>(), t->numElements(), scale);
      else
        return createStringError(inconvertibleErrorCode(), "the norm of %s: float or double only",
                                 t->describe().c_str());
    }
    return total;
  }

  Error addInto(cpu::Tensor &acc, const cpu::Tensor &term) override {
    ++counted.launches;
    return add(acc, term);
  }

  Expected<cpu::Tensor> optimize(const OptimizerUpdate &u, ArrayRef<OptimizerSlot> slots) override {
    // Counted as a device would launch it: one launch a table of slots.
    counted.launches += (static_cast<int64_t>(slots.size()) + OptimizerSlotsPerLaunch - 1) /
                        OptimizerSlotsPerLaunch;
    double squares = 0;
    for (const OptimizerSlot &slot : slots) {
      cpu::Tensor &w = *slot.w;
      const cpu::Tensor &g = *slot.g;
      if (!w.onHost() || !g.onHost())
        return notOnHost(w.onHost() ? g : w);
      bool f32 = w.elemType() == cpu::DType::F32, f64 = w.elemType() == cpu::DType::F64;
      if (!(f32 || f64) || g.elemType() != w.elemType() || g.numElements() != w.numElements())
        return createStringError(inconvertibleErrorCode(),
                                 "training '%s': weight %s, gradient %s (float or double, of one "
                                 "type and size)",
                                 slot.name.str().c_str(), w.describe().c_str(),
                                 g.describe().c_str());
      squares += f32 ? update<float>(u, slot) : update<double>(u, slot);
    }
    cpu::Tensor total(cpu::DType::F64, {1});
    ++counted.allocations;
    total.data<double>()[0] = squares;
    return total;
  }

  Error synchronize() override {
    ++counted.hostSyncs;
    return Error::success();
  }

private:
  BackendCounters counted;

  /// A node's outputs, counted as one launch and an allocation each.
  Expected<std::vector<cpu::Tensor>> launched(Expected<std::vector<cpu::Tensor>> outputs) {
    ++counted.launches;
    if (outputs)
      counted.allocations += static_cast<int64_t>(outputs->size());
    return outputs;
  }

  /// \p acc += \p term (addInto's work, uncounted: sum's terms).
  Error add(cpu::Tensor &acc, const cpu::Tensor &term) {
    if (!acc.onHost() || !term.onHost())
      return notOnHost(acc.onHost() ? term : acc);
    // float16 and bfloat16 are stored as float: a float32 accumulator takes
    // them as they are, and a half one adds in float and rounds (a sum of
    // half gradient terms).
    bool same = acc.elemType() == term.elemType() ||
                (acc.elemType() == cpu::DType::F32 && cpu::storedAs<float>(term.elemType()));
    if (!same || acc.numElements() != term.numElements())
      return createStringError(inconvertibleErrorCode(), "adding %s into %s",
                               term.describe().c_str(), acc.describe().c_str());
    if (acc.elemType() == cpu::DType::F64) {
      addTo(acc.data<double>(), term.data<double>(), acc.numElements());
    } else if (cpu::storedAs<float>(acc.elemType())) {
      addTo(static_cast<float *>(acc.rawData()), static_cast<const float *>(term.rawData()),
            acc.numElements());
      acc.roundToElemType();
    } else
      return createStringError(inconvertibleErrorCode(), "adding %s: float or double only",
                               acc.describe().c_str());
    return Error::success();
  }

  /// One slot's update, in double (kernels::optimizerElement, the body
  /// every backend runs), stored in the weight's type; returns the sum of
  /// the squares of the new weight and second moment. A tensor something
  /// else holds too is replaced (counted as an allocation), never written.
  template <typename T> double update(const OptimizerUpdate &given, const OptimizerSlot &slot) {
    using Kind = OptimizerUpdate::Kind;
    cpu::Tensor &w = *slot.w;
    int64_t n = w.numElements();
    auto own = [&](cpu::Tensor &t, bool needed) {
      if (!needed)
        return;
      if (t.isNull()) // the moments start at zero
        t = cpu::Tensor(w.elemType(), w.shape()), ++counted.allocations;
      else if (!t.ownsBuffer())
        t = t.clone(), ++counted.allocations;
    };
    own(*slot.m, given.kind != Kind::SGD);
    own(*slot.v, given.kind == Kind::AdamW);
    bool inPlace = w.ownsBuffer();
    counted.allocations += inPlace ? 0 : 1;
    cpu::Tensor out = inPlace ? w : cpu::Tensor(w.elemType(), w.shape());
    OptimizerUpdate u = given;
    u.decayCenter = slot.decayCenter;
    kernels::OptimizerParams p = optimizerParams(u);
    const T *wp = w.data<T>(), *gp = slot.g->data<T>();
    T *mp = given.kind != Kind::SGD ? slot.m->data<T>() : nullptr;
    T *vp = given.kind == Kind::AdamW ? slot.v->data<T>() : nullptr;
    T *op = out.data<T>();
    parallelFor(n, blockElements, [&](int64_t begin, int64_t end) {
      cpu::optimizerUpdate(p, wp, gp, mp, vp, op, begin, end);
    });
    w = std::move(out);
    return squaresOf(op, n, 1.0) + (vp ? squaresOf(vp, n, 1.0) : 0.0);
  }
};

} // namespace

std::unique_ptr<Backend> makeCpuBackend() { return std::make_unique<CpuBackend>(); }

//===----------------------------------------------------------------------===//
// The CUDA backend is a plugin (libpipec_cuda_backend.so beside the binary's
// lib/ directory or on the library path): loading cudart, cuBLAS and NCCL
// costs every pipec invocation tens of milliseconds, so only runs that ask
// for the GPU pay it.
//===----------------------------------------------------------------------===//

void *cudaPlugin(std::string *why) {
  static void *handle = nullptr;
  static std::string error;
  static bool tried = false;
  if (!tried) {
    tried = true;
    Dl_info info;
    std::vector<std::string> candidates;
    if (dladdr(reinterpret_cast<void *>(&makeCpuBackend), &info) && info.dli_fname) {
      std::string self = info.dli_fname;
      std::string dir = self.substr(0, self.rfind('/') + 1);
      candidates.push_back(dir + "../lib/libpipec_cuda_backend.so");
      candidates.push_back(dir + "libpipec_cuda_backend.so");
    }
    candidates.push_back("libpipec_cuda_backend.so");
    for (const std::string &c : candidates) {
      handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle)
        break;
      if (const char *e = dlerror())
        error = e;
    }
  }
  if (!handle && why)
    *why = error.empty() ? "libpipec_cuda_backend.so not found" : error;
  return handle;
}

Expected<std::unique_ptr<Backend>> makeCudaBackend(int device, bool bf16) {
  std::string why;
  void *plugin = cudaPlugin(&why);
  if (!plugin)
    return createStringError(inconvertibleErrorCode(),
                             "--backend cuda: this pipec has no CUDA backend (%s); build it where "
                             "the CUDA toolkit is installed",
                             why.c_str());
  using Factory = Backend *(*)(int, bool, Backend *, std::string *);
  auto factory = reinterpret_cast<Factory>(dlsym(plugin, "pipecMakeCudaBackend"));
  if (!factory)
    return createStringError(inconvertibleErrorCode(),
                             "--backend cuda: the CUDA plugin lacks pipecMakeCudaBackend");
  std::string error;
  Backend *backend = factory(device, bf16, makeCpuBackend().release(), &error);
  if (!backend)
    return createStringError(inconvertibleErrorCode(), "--backend cuda: %s", error.c_str());
  return std::unique_ptr<Backend>(backend);
}

Expected<std::unique_ptr<Comm>> makeNcclComm(std::unique_ptr<Comm> bootstrap, int device,
                                             double timeoutSeconds) {
  std::string why;
  void *plugin = cudaPlugin(&why);
  if (!plugin)
    return createStringError(inconvertibleErrorCode(),
                             "--comm nccl: this pipec has no CUDA backend (%s)", why.c_str());
  using Factory = Comm *(*)(Comm *, int, double, std::string *);
  auto factory = reinterpret_cast<Factory>(dlsym(plugin, "pipecMakeNcclComm"));
  if (!factory)
    return createStringError(inconvertibleErrorCode(),
                             "--comm nccl: the CUDA plugin lacks pipecMakeNcclComm");
  std::string error;
  Comm *comm = factory(bootstrap.release(), device, timeoutSeconds, &error);
  if (!comm)
    return createStringError(inconvertibleErrorCode(), "--comm nccl: %s", error.c_str());
  return std::unique_ptr<Comm>(comm);
}

} // namespace pipec::rt
