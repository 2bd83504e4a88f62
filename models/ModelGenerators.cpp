//===- ModelGenerators.cpp - Synthetic ONNX model generators --------------===//
//
// generateModel checks the options and has the family's builder
// (Families.h) lay out the graph on a GraphBuilder. writeModel serializes
// straight to a file stream, optionally moving big initializers to a side
// file.
//
//===----------------------------------------------------------------------===//

#include "models/ModelGenerators.h"
#include "models/Families.h"
#include "support/EnumNames.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MathExtras.h"
#include "llvm/Support/Path.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

using namespace llvm;

namespace pipec::models {
namespace {

Error makeError(const Twine &msg) { return createStringError(inconvertibleErrorCode(), msg); }

Error validate(const GeneratorOptions &o) {
  if (o.opset < 13 || o.opset > 17)
    return makeError("unsupported opset " + Twine(o.opset) + " (supported: 13..17)");
  if (o.layers < 1 || o.hidden < 1 || o.heads < 1 || o.vocab < 1 || o.seq < 1)
    return makeError("layers, hidden, heads, vocab and seq must be positive");
  if (o.batch < 0 || o.ffn < 0 || o.kvHeads < 0)
    return makeError("batch, ffn and kvHeads must not be negative");
  bool transformer =
      o.family == Family::Gpt || o.family == Family::Llama || o.family == Family::Bert;
  if (transformer && o.hidden % o.heads != 0)
    return makeError("hidden (" + Twine(o.hidden) + ") must be divisible by heads (" +
                     Twine(o.heads) + ")");
  if (o.family == Family::Llama) {
    int kv = o.kvHeads ? o.kvHeads : o.heads;
    if (o.heads % kv != 0)
      return makeError("heads (" + Twine(o.heads) + ") must be divisible by kvHeads (" + Twine(kv) +
                       ")");
    if ((o.hidden / o.heads) % 2 != 0)
      return makeError("llama head dimension (" + Twine(o.hidden / o.heads) +
                       ") must be even for rotary embeddings");
  }
  return Error::success();
}

/// Copies \p from into \p to except the graph's initializers.
void copyAllButInitializers(const onnx::ModelProto &from, onnx::ModelProto &to) {
  to.set_ir_version(from.ir_version());
  *to.mutable_opset_import() = from.opset_import();
  to.set_producer_name(from.producer_name());
  to.set_producer_version(from.producer_version());
  to.set_domain(from.domain());
  to.set_model_version(from.model_version());
  to.set_doc_string(from.doc_string());
  *to.mutable_metadata_props() = from.metadata_props();
  *to.mutable_training_info() = from.training_info();
  *to.mutable_functions() = from.functions();
  const onnx::GraphProto &fg = from.graph();
  onnx::GraphProto &tg = *to.mutable_graph();
  *tg.mutable_node() = fg.node();
  tg.set_name(fg.name());
  *tg.mutable_sparse_initializer() = fg.sparse_initializer();
  tg.set_doc_string(fg.doc_string());
  *tg.mutable_input() = fg.input();
  *tg.mutable_output() = fg.output();
  *tg.mutable_value_info() = fg.value_info();
  *tg.mutable_quantization_annotation() = fg.quantization_annotation();
}

std::string errnoText() { return std::strerror(errno); }

/// Renames the finished \p temp over \p path; on failure removes \p temp,
/// so no partial file is left under either name.
Error commitTemp(const std::string &temp, StringRef path) {
  if (std::error_code ec = sys::fs::rename(temp, path)) {
    sys::fs::remove(temp);
    return makeError("cannot write '" + path + "': " + ec.message());
  }
  return Error::success();
}

/// The file a writer of \p path fills before renaming it into place: in
/// the same folder, so the rename stays on one file system.
std::string tempFor(StringRef path) { return (path + ".tmp").str(); }

/// Serializes \p model to \p path through a buffered file stream, into a
/// temporary file renamed into place: a full disk or a killed process leaves
/// the old file or none, never a partial one.
Error writeProto(const onnx::ModelProto &model, StringRef path) {
  size_t size = model.ByteSizeLong();
  if (size > size_t(INT_MAX))
    return makeError("cannot write '" + path + "': the model would take " + Twine(size) +
                     " bytes, over protobuf's 2 GiB limit; use external data");
  std::string temp = tempFor(path);
  std::ofstream os(temp, std::ios::binary | std::ios::trunc);
  if (!os)
    return makeError("cannot open '" + path + "' for writing: " + errnoText());
  bool ok;
  {
    google::protobuf::io::OstreamOutputStream zeroCopy(&os, 1 << 20);
    google::protobuf::io::CodedOutputStream coded(&zeroCopy);
    coded.SetSerializationDeterministic(true);
    model.SerializeWithCachedSizes(&coded);
    ok = !coded.HadError();
  }
  os.close();
  if (!ok || !os) {
    std::string why = errnoText();
    sys::fs::remove(temp);
    return makeError("failed writing '" + path + "': " + why);
  }
  return commitTemp(temp, path);
}

constexpr EnumName<Family> familyNames[] = {
    {Family::Gpt, "gpt"}, {Family::Llama, "llama"},   {Family::Bert, "bert"},
    {Family::Mlp, "mlp"}, {Family::Resnet, "resnet"},
};

} // namespace

Expected<Family> parseFamily(StringRef name) {
  if (std::optional<Family> family = valueOf(familyNames, name.lower()))
    return *family;
  return makeError("unknown model family '" + name + "' (expected " + nameList(familyNames) + ")");
}

StringRef familyName(Family f) { return nameOf(familyNames, f, ""); }

Expected<onnx::ModelProto> generateModel(const GeneratorOptions &opts) {
  if (Error e = validate(opts))
    return e;
  try {
    onnx::ModelProto model;
    model.set_ir_version(8);
    model.set_producer_name("pipec");
    model.set_producer_version("0.1");
    onnx::OperatorSetIdProto *opset = model.add_opset_import();
    opset->set_domain("");
    opset->set_version(opts.opset);
    onnx::GraphProto *graph = model.mutable_graph();
    graph->set_name("main_graph");
    GraphBuilder g(*graph, opts);
    switch (opts.family) {
    case Family::Gpt:
      buildGpt(g);
      break;
    case Family::Llama:
      buildLlama(g);
      break;
    case Family::Bert:
      buildBert(g);
      break;
    case Family::Mlp:
      buildMlp(g);
      break;
    case Family::Resnet:
      buildResnet(g);
      break;
    }
    return model;
  } catch (const std::exception &e) {
    return makeError(Twine("model generation failed: ") + e.what());
  }
}

Error writeModel(const onnx::ModelProto &model, StringRef path, bool externalData,
                 uint64_t externalThreshold) {
  try {
    if (!externalData)
      return writeProto(model, path);

    std::string dataPath = (path + ".data").str();
    std::string location = sys::path::filename(dataPath).str();
    std::string dataTemp = tempFor(dataPath);
    std::ofstream data(dataTemp, std::ios::binary | std::ios::trunc);
    if (!data)
      return makeError("cannot open '" + dataPath + "' for writing: " + errnoText());

    onnx::ModelProto out;
    copyAllButInitializers(model, out);
    uint64_t offset = 0;
    static const char zeros[64] = {};
    for (const onnx::TensorProto &init : model.graph().initializer()) {
      onnx::TensorProto *t = out.mutable_graph()->add_initializer();
      if (init.data_location() == onnx::TensorProto::EXTERNAL ||
          init.raw_data().size() < externalThreshold) {
        *t = init;
        continue;
      }
      t->set_name(init.name());
      t->set_data_type(init.data_type());
      *t->mutable_dims() = init.dims();
      if (init.has_doc_string())
        t->set_doc_string(init.doc_string());
      uint64_t aligned = alignTo(offset, 64);
      data.write(zeros, aligned - offset);
      const std::string &raw = init.raw_data();
      data.write(raw.data(), raw.size());
      t->set_data_location(onnx::TensorProto::EXTERNAL);
      auto addEntry = [&](StringRef key, const std::string &value) {
        onnx::StringStringEntryProto *e = t->add_external_data();
        e->set_key(key.str());
        e->set_value(value);
      };
      addEntry("location", location);
      addEntry("offset", std::to_string(aligned));
      addEntry("length", std::to_string(raw.size()));
      offset = aligned + raw.size();
    }
    data.close();
    if (!data) {
      std::string why = errnoText();
      sys::fs::remove(dataTemp);
      return makeError("failed writing '" + dataPath + "': " + why);
    }
    // The data first: a model file never names data that is not complete.
    if (Error err = commitTemp(dataTemp, dataPath))
      return err;
    return writeProto(out, path);
  } catch (const std::exception &e) {
    return makeError("cannot write '" + path + "': " + e.what());
  }
}

} // namespace pipec::models
