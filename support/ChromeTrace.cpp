//===- ChromeTrace.cpp - Timelines as Chrome / Perfetto trace JSON -------===//
#include "support/ChromeTrace.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"

using namespace llvm;

namespace pipec {

void printChromeTrace(raw_ostream &os, ArrayRef<int> ranks, ArrayRef<TraceEvent> events,
                      double origin) {
  json::OStream j(os, 1);
  j.object([&] {
    j.attribute("displayTimeUnit", "ms");
    j.attributeArray("traceEvents", [&] {
      for (int r : ranks)
        for (int comm = 0; comm < 2; ++comm)
          j.object([&] {
            j.attribute("name", "thread_name");
            j.attribute("ph", "M");
            j.attribute("pid", 0);
            j.attribute("tid", 2 * r + comm);
            j.attributeObject("args", [&] {
              j.attribute("name", formatv("rank {0}{1}", r, comm ? " comm" : "").str());
            });
          });
      for (const TraceEvent &e : events)
        j.object([&] {
          j.attribute("name", e.name);
          j.attribute("cat", std::string(1, e.category));
          j.attribute("ph", "X");
          j.attribute("pid", 0);
          j.attribute("tid", 2 * e.rank + (e.category == 'C' ? 1 : 0));
          j.attribute("ts", (e.start - origin) * 1e6);
          j.attribute("dur", e.duration * 1e6);
        });
    });
  });
  os << "\n";
}

Expected<std::vector<TraceEvent>> parseChromeTrace(StringRef text) {
  auto fail = [](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s", why.str().c_str());
  };
  auto parsed = json::parse(text);
  if (!parsed)
    return fail("not JSON: " + toString(parsed.takeError()));
  const json::Object *root = parsed->getAsObject();
  const json::Array *list = root ? root->getArray("traceEvents") : nullptr;
  if (!list)
    return fail("not a Chrome trace (no traceEvents)");
  std::vector<TraceEvent> events;
  for (const json::Value &v : *list) {
    const json::Object *e = v.getAsObject();
    if (!e || e->getString("ph").getValueOr("") != "X")
      continue;
    TraceEvent t;
    t.rank = static_cast<int>(e->getInteger("tid").getValueOr(0) / 2);
    t.name = e->getString("name").getValueOr("").str();
    StringRef cat = e->getString("cat").getValueOr("F");
    t.category = cat.empty() ? 'F' : cat[0];
    t.start = e->getNumber("ts").getValueOr(0) / 1e6;
    t.duration = e->getNumber("dur").getValueOr(0) / 1e6;
    events.push_back(std::move(t));
  }
  return events;
}

} // namespace pipec
