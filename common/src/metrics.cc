// Metrics: the registry (counters, histograms, callbacks), its Prometheus text exposition
// (Registry::Render) and the exposition parser (ParseExposition, Find) that tests and
// farmemctl read it back with. The HTTP responder and client are metrics_http.cc.
#include "farmem/common/metrics.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

namespace farmem::metrics {

namespace {

bool ValidName(std::string_view n, bool label) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

void CheckNames(std::string_view name, const Labels& labels) {
  bool ok = ValidName(name, false);
  for (const auto& [k, v] : labels) ok = ok && ValidName(k, true) && k != "le";
  if (!ok) {
    spdlog::critical("metrics: invalid metric or label name in '{}' (a bug)", name);
    std::abort();
  }
}

const char* TypeName(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendEscaped(std::string* out, std::string_view v, bool quote) {
  for (char c : v) {
    if (c == '\\') {
      *out += "\\\\";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '"' && quote) {
      *out += "\\\"";
    } else {
      *out += c;
    }
  }
}

void AppendValue(std::string* out, double v) {
  if (std::isnan(v)) {
    *out += "NaN";
  } else if (std::isinf(v)) {
    *out += v > 0 ? "+Inf" : "-Inf";
  } else if (v == std::floor(v) && std::fabs(v) < 1e15) {
    *out += fmt::format("{}", static_cast<int64_t>(v));
  } else {
    *out += fmt::format("{}", v);
  }
}

void AppendSample(std::string* out, std::string_view name, const Labels& labels,
                  const std::pair<std::string, std::string>* extra, double v) {
  *out += name;
  if (!labels.empty() || extra != nullptr) {
    *out += '{';
    bool first = true;
    auto one = [&](const std::string& k, const std::string& val) {
      if (!first) *out += ',';
      first = false;
      *out += k;
      *out += "=\"";
      AppendEscaped(out, val, true);
      *out += '"';
    };
    for (const auto& [k, val] : labels) one(k, val);
    if (extra != nullptr) one(extra->first, extra->second);
    *out += '}';
  }
  *out += ' ';
  AppendValue(out, v);
  *out += '\n';
}

std::string FormatBound(double b) {
  std::string s;
  AppendValue(&s, b);
  return s;
}

}  // namespace

// ---- Histogram ----

Histogram::Histogram(std::vector<uint64_t> upper_bounds, double scale)
    : bounds_(std::move(upper_bounds)),
      scale_(scale),
      buckets_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  if (bounds_.size() >= 0xffff) std::abort();  // a programming error: first_ holds uint16_t
  for (size_t w = 0; w < first_.size(); ++w) {
    const uint64_t least = w == 0 ? 0 : uint64_t{1} << (w - 1);  // smallest value of width w
    size_t i = 0;
    while (i < bounds_.size() && bounds_[i] < least) ++i;
    first_[w] = static_cast<uint16_t>(i);
  }
}

std::vector<uint64_t> Histogram::Buckets() const {
  std::vector<uint64_t> b(bounds_.size() + 1);
  for (size_t i = 0; i < b.size(); ++i) b[i] = buckets_[i].load(std::memory_order_relaxed);
  return b;
}

std::vector<uint64_t> LatencyBoundsNs() {
  std::vector<uint64_t> b;
  for (uint64_t us : {10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000,
                      250000, 500000, 1000000, 5000000}) {
    b.push_back(us * 1000);
  }
  return b;
}

// ---- Registry ----

struct Registry::Family {
  std::string name, help;
  Type type;
  std::vector<std::pair<Labels, std::unique_ptr<Counter>>> counters;
  std::vector<std::pair<Labels, std::unique_ptr<Histogram>>> histograms;
  std::vector<std::function<void(const Emit&)>> callbacks;
};

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Family& Registry::FamilyFor(std::string_view name, std::string_view help, Type type) {
  for (auto& f : families_) {
    if (f->name == name) {
      if (f->type != type) {
        spdlog::critical("metrics: '{}' registered with two types (a bug)", name);
        std::abort();
      }
      return *f;
    }
  }
  auto f = std::make_unique<Family>();
  f->name = std::string(name);
  f->help = std::string(help);
  f->type = type;
  families_.push_back(std::move(f));
  return *families_.back();
}

Counter& Registry::AddCounter(std::string_view name, std::string_view help, Labels labels) {
  CheckNames(name, labels);
  MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, Type::kCounter);
  f.counters.emplace_back(std::move(labels), std::make_unique<Counter>());
  return *f.counters.back().second;
}

Histogram& Registry::AddHistogram(std::string_view name, std::string_view help, Labels labels,
                                  std::vector<uint64_t> upper_bounds, double scale) {
  CheckNames(name, labels);
  MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, Type::kHistogram);
  f.histograms.emplace_back(std::move(labels),
                            std::make_unique<Histogram>(std::move(upper_bounds), scale));
  return *f.histograms.back().second;
}

void Registry::AddCallback(std::string_view name, std::string_view help, Type type,
                           std::function<void(const Emit&)> collect) {
  CheckNames(name, {});
  MutexLock lock(&mu_);
  FamilyFor(name, help, type).callbacks.push_back(std::move(collect));
}

std::string Registry::Render() const {
  MutexLock lock(&mu_);
  std::string out;
  out.reserve(16384);
  for (const auto& f : families_) {
    out += "# HELP ";
    out += f->name;
    out += ' ';
    AppendEscaped(&out, f->help, false);
    out += "\n# TYPE ";
    out += f->name;
    out += ' ';
    out += TypeName(f->type);
    out += '\n';
    for (const auto& [labels, c] : f->counters) {
      AppendSample(&out, f->name, labels, nullptr, static_cast<double>(c->value()));
    }
    for (const auto& [labels, h] : f->histograms) {
      const std::vector<uint64_t> b = h->Buckets();
      uint64_t cum = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        cum += b[i];
        const std::pair<std::string, std::string> le{
            "le", i < h->bounds().size()
                      ? FormatBound(static_cast<double>(h->bounds()[i]) * h->scale())
                      : "+Inf"};
        AppendSample(&out, f->name + "_bucket", labels, &le, static_cast<double>(cum));
      }
      AppendSample(&out, f->name + "_sum", labels, nullptr,
                   static_cast<double>(h->sum()) * h->scale());
      AppendSample(&out, f->name + "_count", labels, nullptr, static_cast<double>(cum));
    }
    for (const auto& collect : f->callbacks) {
      collect([&](const Labels& labels, double v) {
        CheckNames(f->name, labels);
        AppendSample(&out, f->name, labels, nullptr, v);
      });
    }
  }
  return out;
}

// ---- parsing ----

std::string Sample::Label(std::string_view key) const {
  for (const auto& [k, v] : labels) {
    if (k == key) return v;
  }
  return "";
}

namespace {

Status LineError(size_t line, std::string_view text, std::string_view why) {
  return InvalidArgument(fmt::format("metrics exposition line {}: {}: '{}'", line, why,
                                     text.substr(0, std::min<size_t>(text.size(), 120))));
}

bool ParseDouble(std::string_view s, double* v) {
  if (s == "NaN") {
    *v = std::nan("");
    return true;
  }
  if (s == "+Inf" || s == "Inf") {
    *v = HUGE_VAL;
    return true;
  }
  if (s == "-Inf") {
    *v = -HUGE_VAL;
    return true;
  }
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (*b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, *v);
  return ec == std::errc() && p == e;
}

// The family a sample name belongs to, given the declared types.
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  if (types.count(name)) return name;
  for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      std::string base = name.substr(0, name.size() - suffix.size());
      auto it = types.find(base);
      if (it != types.end() && it->second == "histogram") return base;
    }
  }
  return "";
}

}  // namespace

Result<std::vector<Sample>> ParseExposition(std::string_view text) {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;
  std::set<std::string> finished;  // families whose lines are over
  std::set<std::string> series;
  std::string current;
  size_t line_no = 0;
  if (!text.empty() && !text.ends_with('\n')) {
    return Err(InvalidArgument("metrics exposition does not end with a newline"));
  }
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line.empty()) continue;
    if (line[0] == '#') {
      // "# HELP name text" / "# TYPE name type"; other comments are allowed.
      if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
        const bool type = line.starts_with("# TYPE ");
        std::string_view rest = line.substr(7);
        const size_t sp = rest.find(' ');
        const std::string name(rest.substr(0, sp));
        if (!ValidName(name, false)) return Err(LineError(line_no, line, "invalid metric name"));
        if (type) {
          const std::string_view t = sp == std::string_view::npos ? "" : rest.substr(sp + 1);
          if (t != "counter" && t != "gauge" && t != "histogram" && t != "summary" &&
              t != "untyped") {
            return Err(LineError(line_no, line, "unknown metric type"));
          }
          if (types.count(name)) return Err(LineError(line_no, line, "second TYPE line"));
          types[name] = std::string(t);
        }
        if (name != current) {
          if (!current.empty()) finished.insert(current);
          if (finished.count(name)) {
            return Err(LineError(line_no, line, "family continues after other families"));
          }
          current = name;
        }
      }
      continue;
    }
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (!ValidName(s.name, false)) return Err(LineError(line_no, line, "invalid metric name"));
    if (i < line.size() && line[i] == '{') {
      ++i;
      for (;;) {
        if (i < line.size() && line[i] == '}') {
          ++i;
          break;
        }
        size_t k = i;
        while (k < line.size() && line[k] != '=') ++k;
        std::string key(line.substr(i, k - i));
        if (!ValidName(key, true)) return Err(LineError(line_no, line, "invalid label name"));
        if (k + 1 >= line.size() || line[k + 1] != '"') {
          return Err(LineError(line_no, line, "label value not quoted"));
        }
        i = k + 2;
        std::string value;
        bool closed = false;
        while (i < line.size()) {
          const char c = line[i++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c == '\\') {
            if (i >= line.size()) break;
            const char e = line[i++];
            if (e == 'n') {
              value += '\n';
            } else if (e == '\\' || e == '"') {
              value += e;
            } else {
              return Err(LineError(line_no, line, "invalid escape in label value"));
            }
          } else {
            value += c;
          }
        }
        if (!closed) return Err(LineError(line_no, line, "unterminated label value"));
        for (const auto& [ek, ev] : s.labels) {
          if (ek == key) return Err(LineError(line_no, line, "label given twice"));
        }
        s.labels.emplace_back(std::move(key), std::move(value));
        if (i < line.size() && line[i] == ',') ++i;
      }
    }
    if (i >= line.size() || line[i] != ' ') return Err(LineError(line_no, line, "no value"));
    std::string_view value = line.substr(i + 1);
    const size_t sp = value.find(' ');  // an optional timestamp follows
    if (sp != std::string_view::npos) {
      int64_t ts = 0;
      std::string_view t = value.substr(sp + 1);
      auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), ts);
      if (ec != std::errc() || p != t.data() + t.size()) {
        return Err(LineError(line_no, line, "invalid timestamp"));
      }
      value = value.substr(0, sp);
    }
    if (!ParseDouble(value, &s.value)) return Err(LineError(line_no, line, "invalid value"));
    const std::string family = FamilyOf(s.name, types);
    if (family.empty()) return Err(LineError(line_no, line, "sample without a TYPE line"));
    if (family != current) {
      if (!current.empty()) finished.insert(current);
      if (finished.count(family)) {
        return Err(LineError(line_no, line, "family continues after other families"));
      }
      current = family;
    }
    std::string key = s.name;
    for (const auto& [k, v] : s.labels) key += "\x1f" + k + "\x1e" + v;
    if (!series.insert(key).second) return Err(LineError(line_no, line, "series repeated"));
    samples.push_back(std::move(s));
  }
  // Histograms: per series (labels without le), buckets cumulative, +Inf present and == _count.
  std::map<std::string, std::pair<double, bool>> last_bucket;  // series -> (value, saw +Inf)
  for (const Sample& s : samples) {
    if (!s.name.ends_with("_bucket")) continue;
    const std::string family = s.name.substr(0, s.name.size() - 7);
    auto t = types.find(family);
    if (t == types.end() || t->second != "histogram") continue;
    std::string key = family;
    std::string le;
    for (const auto& [k, v] : s.labels) {
      if (k == "le") {
        le = v;
      } else {
        key += "\x1f" + k + "\x1e" + v;
      }
    }
    double bound = 0;
    if (!ParseDouble(le, &bound)) {
      return Err(InvalidArgument(fmt::format("histogram {}: bucket without a valid le", family)));
    }
    auto [it, inserted] = last_bucket.try_emplace(key, s.value, false);
    if (!inserted && s.value < it->second.first) {
      return Err(InvalidArgument(fmt::format("histogram {}: buckets are not cumulative", family)));
    }
    it->second.first = s.value;
    if (std::isinf(bound)) it->second.second = true;
  }
  for (const auto& [key, v] : last_bucket) {
    if (!v.second) {
      return Err(InvalidArgument(fmt::format("histogram series {} has no le=\"+Inf\" bucket",
                                             key.substr(0, key.find('\x1f')))));
    }
  }
  for (const Sample& s : samples) {
    if (!s.name.ends_with("_count")) continue;
    const std::string family = s.name.substr(0, s.name.size() - 6);
    auto t = types.find(family);
    if (t == types.end() || t->second != "histogram") continue;
    std::string key = family;
    for (const auto& [k, v] : s.labels) key += "\x1f" + k + "\x1e" + v;
    auto it = last_bucket.find(key);
    if (it == last_bucket.end() || it->second.first != s.value) {
      return Err(InvalidArgument(
          fmt::format("histogram {}: _count differs from the +Inf bucket", family)));
    }
  }
  return samples;
}

std::optional<double> Find(const std::vector<Sample>& samples, std::string_view name,
                           const Labels& match) {
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool all = true;
    for (const auto& [k, v] : match) all = all && s.Label(k) == v;
    if (all) return s.value;
  }
  return std::nullopt;
}

}  // namespace farmem::metrics
