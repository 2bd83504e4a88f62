//===- KernelTestUtil.h - Node builders for the runtime's kernel tests ---===//
//
// Header-only, ONNX messages only: the runtime tests link the runtime
// libraries and never the compiler (TestUtil.h brings the compiler's).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_KERNELTESTUTIL_H
#define PIPEC_TESTS_KERNELTESTUTIL_H

#include "onnx/onnx_pb.h"

#include <string>
#include <vector>

namespace pipec::test {

/// A node of one output named \p output (and named after it), reading
/// \p inputs.
inline onnx::NodeProto makeNode(const std::string &op, const std::vector<std::string> &inputs,
                                const std::string &output, const std::string &domain = "") {
  onnx::NodeProto n;
  n.set_op_type(op);
  n.set_domain(domain);
  n.set_name(output);
  for (const std::string &in : inputs)
    n.add_input(in);
  n.add_output(output);
  return n;
}

} // namespace pipec::test

#endif // PIPEC_TESTS_KERNELTESTUTIL_H
