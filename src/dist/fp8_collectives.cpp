// FP8-compressed collectives (see dist/fp8_collectives.h): cast, pack [inv_scale | fp8 bytes]
// rows, one engine collective over bytes, dequantize, add in fp32 in rank order.
#include "colossal/dist/fp8_collectives.h"

#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "colossal/core/error.h"
#include "colossal/kernels/fp8.h"
#include "dist/communicator_impl.h"

namespace colossal::dist {
namespace {

bool float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_float(const char* op, const char* role, const at::Tensor& t) {
  COLOSSAL_CHECK_INPUT(t.defined(), op, ": ", role, " tensor is undefined");
  COLOSSAL_CHECK_INPUT(float_dtype(t.scalar_type()), op, ": ", role, " tensor has dtype ",
                       t.scalar_type(), "; FP8 communication takes float, bfloat16 or half");
}

void check_op(const char* op, ReduceOp r) {
  COLOSSAL_CHECK_INPUT(r == ReduceOp::Sum || r == ReduceOp::Avg, op, ": reduce op ", to_string(r),
                       " is not available in FP8 (sum or avg only)");
}

// Words (fp32) of one packed row: the inverse scale, then n fp8 bytes padded to whole words.
int64_t row_words(int64_t n) {
  return 1 + (n + 3) / 4;
}

// x: [rows, n] (rows == 1: one tensorwise scale; else one scale per row). Returns the packed
// rows as bytes, [rows, 4 * row_words(n)].
at::Tensor cast_and_pack(const at::Tensor& x, at::ScalarType fp8) {
  const int64_t rows = x.size(0), n = x.size(1), words = row_words(n);
  kernels::Fp8Tensor q = kernels::cast_to_fp8(x, fp8, /*rowwise=*/rows > 1, /*transpose=*/false);
  at::Tensor buf = at::empty({rows, words}, x.options().dtype(at::kFloat));
  buf.select(1, 0).copy_(q.inv_scale.reshape({rows}));
  at::Tensor bytes = buf.view(at::kByte);
  bytes.narrow(1, 4, n).copy_(q.data.view(at::kByte));
  const int64_t pad = 4 * words - 4 - n;
  if (pad > 0) bytes.narrow(1, 4 + n, pad).zero_();  // deterministic bytes on the wire
  return bytes;
}

// Packed rows (bytes [rows, 4 * row_words(n)]) -> [rows, n] fp32: fp8 value * inv_scale.
at::Tensor dequantize(const at::Tensor& bytes, int64_t n, at::ScalarType fp8) {
  const int64_t rows = bytes.size(0);
  at::Tensor words = bytes.view(at::kFloat);
  at::Tensor inv = words.narrow(1, 0, 1);
  at::Tensor data = bytes.narrow(1, 4, n).view(fp8);
  return data.to(at::kFloat) * inv.reshape({rows, 1});
}

// Rows added in fp32 in rank order (row 0 first), divided by their count for Avg.
at::Tensor sum_rows(const at::Tensor& deq, ReduceOp op) {
  at::Tensor acc = deq.select(0, 0).clone();
  for (int64_t r = 1; r < deq.size(0); ++r) acc.add_(deq.select(0, r));
  if (op == ReduceOp::Avg) acc.div_(static_cast<double>(deq.size(0)));
  return acc;
}

// A Work that runs `fn` (which waits for the engine's work and finishes the operation) in wait().
Work deferred(Communicator& comm, const char* op, at::ScalarType fp8, std::function<void()> fn,
              bool async_op) {
  auto w = std::make_shared<Work::Impl>();
  w->finish = std::move(fn);
  w->what = str(op, "(", fp8, ") on group '", comm.name(), "' (rank ", comm.rank(), " of ",
                comm.size(), ")");
  w->timeout = comm.timeout();
  w->blocking_wait = false;  // nothing of its own to wait for: the engine Works are in `fn`
  Work work(std::move(w));
  if (!async_op) work.wait();
  return work;
}

// Phase 1 of reduce_scatter / all_reduce: x [size, m] -> each rank gets every rank's slice for
// it, packed ([size, 4 * row_words(m)] bytes), when `work` completes.
struct Scatter {
  Work work;
  at::Tensor recv;
};
Scatter exchange_slices(Communicator& comm, const at::Tensor& x, at::ScalarType fp8) {
  Scatter s;
  at::Tensor send = cast_and_pack(x, fp8);
  s.recv = at::empty_like(send);
  if (comm.size() == 1) {
    s.recv = send;
  } else {
    s.work = comm.all_to_all(s.recv, send, /*async_op=*/true);
  }
  return s;
}

// x: [1, n] -> packed rows of every rank, [size, 4 * row_words(n)] bytes.
at::Tensor gather_rows(Communicator& comm, const at::Tensor& x, at::ScalarType fp8, Work* work) {
  at::Tensor send = cast_and_pack(x, fp8);
  if (comm.size() == 1) return send;
  at::Tensor recv = at::empty({comm.size(), send.size(1)}, send.options());
  *work = comm.all_gather(recv, send, /*async_op=*/true);
  return recv;
}

}  // namespace

at::ScalarType fp8_format(const std::string& name) {
  if (name == "e4m3") return at::kFloat8_e4m3fn;
  if (name == "e5m2") return at::kFloat8_e5m2;
  throw InputError(str("FP8 format '", name, "' is not one of e4m3, e5m2"));
}

Work reduce_scatter_fp8(Communicator& comm, at::Tensor& output, const at::Tensor& input,
                        at::ScalarType fp8, ReduceOp op, bool async_op) {
  check_float("reduce_scatter_fp8", "input", input);
  check_float("reduce_scatter_fp8", "output", output);
  check_op("reduce_scatter_fp8", op);
  kernels::fp8_max(fp8);
  const int64_t w = comm.size(), m = output.numel();
  COLOSSAL_CHECK_INPUT(input.numel() == w * m, "reduce_scatter_fp8 on group '", comm.name(),
                       "': input has ", input.numel(), " elements, expected size ", w, " x output ",
                       m);
  if (m == 0) return Work();
  Scatter s = exchange_slices(comm, input.reshape({w, m}), fp8);
  at::Tensor out = output;
  return deferred(
      comm, "reduce_scatter_fp8", fp8,
      [s, out, m, fp8, op]() mutable {
        s.work.wait();
        at::Tensor acc = sum_rows(dequantize(s.recv, m, fp8), op);
        out.copy_(acc.view(out.sizes()));
      },
      async_op);
}

Work all_gather_fp8(Communicator& comm, at::Tensor& output, const at::Tensor& input,
                    at::ScalarType fp8, bool async_op) {
  check_float("all_gather_fp8", "input", input);
  check_float("all_gather_fp8", "output", output);
  kernels::fp8_max(fp8);
  const int64_t w = comm.size(), n = input.numel();
  COLOSSAL_CHECK_INPUT(output.numel() == w * n, "all_gather_fp8 on group '", comm.name(),
                       "': output has ", output.numel(), " elements, expected size ", w,
                       " x input ", n);
  if (n == 0) return Work();
  Work work;
  at::Tensor recv = gather_rows(comm, input.reshape({1, n}), fp8, &work);
  at::Tensor out = output;
  return deferred(
      comm, "all_gather_fp8", fp8,
      [work, recv, out, n, fp8]() mutable {
        work.wait();
        out.copy_(dequantize(recv, n, fp8).view(out.sizes()));
      },
      async_op);
}

Work all_reduce_fp8(Communicator& comm, at::Tensor& tensor, at::ScalarType fp8, ReduceOp op,
                    bool async_op) {
  check_float("all_reduce_fp8", "tensor", tensor);
  check_op("all_reduce_fp8", op);
  kernels::fp8_max(fp8);
  const int64_t n = tensor.numel(), w = comm.size(), m = (n + w - 1) / w;
  if (n == 0) return Work();
  at::Tensor padded;
  if (n == w * m) {
    padded = tensor.reshape({w, m});
  } else {  // zeros past the end: they change no scale and reduce to zeros that are dropped
    padded = at::zeros({w, m}, tensor.options());
    padded.view({-1}).narrow(0, 0, n).copy_(tensor.reshape({-1}));
  }
  Scatter s = exchange_slices(comm, padded, fp8);
  at::Tensor out = tensor;
  Communicator c = comm;
  return deferred(
      comm, "all_reduce_fp8", fp8,
      [s, c, out, n, m, fp8, op]() mutable {
        s.work.wait();
        // This rank's reduced slice, requantized with its own scale and gathered by every rank.
        at::Tensor acc = sum_rows(dequantize(s.recv, m, fp8), op);
        Work gather;
        at::Tensor rows = gather_rows(c, acc.view({1, m}), fp8, &gather);
        gather.wait();
        at::Tensor full = dequantize(rows, m, fp8).view({-1}).narrow(0, 0, n);
        out.copy_(full.view(out.sizes()));
      },
      async_op);
}

}  // namespace colossal::dist
