//===- CliSupport.cpp - What pipec's commands share ----------------------===//
#include "tools/CliSupport.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

using namespace llvm;

namespace pipec::cli {

int reportError(Error err) {
  int code = exitInput;
  std::string text;
  handleAllErrors(
      std::move(err),
      [&](const UsageError &e) {
        code = exitUsage;
        text += (text.empty() ? "" : "; ") + e.message();
      },
      [&](const ErrorInfoBase &e) { text += (text.empty() ? "" : "; ") + e.message(); });
  WithColor::error(errs(), "pipec") << text << "\n";
  return code;
}

int badUsage(const Twine &what) { return reportError(usageError(what)); }

Error checkNotAnInput(StringRef flag, StringRef output, ArrayRef<StringRef> inputs) {
  if (output.empty())
    return Error::success();
  if (Error err = checkOutputPath(output))
    return err;
  for (StringRef input : inputs)
    if (!input.empty() && (output == input || sys::fs::equivalent(output, input)))
      return usageError(flag + " " + output + ": is an input of this command; write elsewhere");
  return Error::success();
}

} // namespace pipec::cli
