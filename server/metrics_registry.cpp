#include "metrics_registry.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>

namespace cellblock {

namespace {

bool valid_name(std::string_view name, bool label) {
    if (name.empty()) return false;
    for (std::size_t i = 0; i < name.size(); ++i) {
        const char c = name[i];
        const bool alpha =
            (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
        if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return !(label && name.starts_with("__"));
}

// Label values: backslash, double quote and line feed escaped (both formats).
void append_label_value(std::string& out, std::string_view value) {
    for (const char c : value) {
        if (c == '\\') {
            out += "\\\\";
        } else if (c == '"') {
            out += "\\\"";
        } else if (c == '\n') {
            out += "\\n";
        } else {
            out += c;
        }
    }
}

// HELP text: backslash and line feed escaped; OpenMetrics escapes quotes too.
void append_help(std::string& out, std::string_view help, MetricsFormat format) {
    for (const char c : help) {
        if (c == '\\') {
            out += "\\\\";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '"' && format == MetricsFormat::openmetrics) {
            out += "\\\"";
        } else {
            out += c;
        }
    }
}

void append_labels(std::string& out, const std::vector<std::string>& names,
                   const LabelValues& values, std::string_view le = {}) {
    if (names.empty() && le.empty()) return;
    out += '{';
    for (std::size_t i = 0; i < names.size(); ++i) {
        if (i > 0) out += ',';
        out += names[i];
        out += "=\"";
        append_label_value(out, values[i]);
        out += '"';
    }
    if (!le.empty()) {
        if (!names.empty()) out += ',';
        out += "le=\"";
        out += le;
        out += '"';
    }
    out += '}';
}

void append_sample(std::string& out, std::string_view name, const std::vector<std::string>& names,
                   const LabelValues& values, double value, std::string_view le = {}) {
    out += name;
    append_labels(out, names, values, le);
    out += ' ';
    out += metric_number(value);
    out += '\n';
}

}  // namespace

std::string_view metrics_content_type(MetricsFormat format) {
    return format == MetricsFormat::openmetrics
               ? "application/openmetrics-text; version=1.0.0; charset=utf-8"
               : "text/plain; version=0.0.4; charset=utf-8";
}

std::string metric_number(double value, bool force_float) {
    if (std::isnan(value)) return "NaN";
    if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
    char buffer[64];
    const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, value);
    std::string text(buffer, ec == std::errc() ? end : buffer);
    if (force_float && text.find_first_of(".e") == std::string::npos) text += ".0";
    return text;
}

MetricFamily::MetricFamily(std::mutex& mutex, Kind kind, std::string name, std::string help,
                           std::vector<std::string> label_names, std::vector<double> buckets)
    : mutex_(mutex),
      kind_(kind),
      name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      bounds_(std::move(buckets)) {}

MetricFamily::Series& MetricFamily::series(const LabelValues& labels) {
    if (labels.size() != label_names_.size()) {
        throw std::invalid_argument("metric " + name_ + ": " + std::to_string(labels.size()) +
                                    " label values for " + std::to_string(label_names_.size()) +
                                    " labels");
    }
    auto [it, made] = series_.try_emplace(labels);
    if (made && kind_ == Kind::histogram) it->second.buckets.assign(bounds_.size() + 1, 0);
    return it->second;
}

void MetricFamily::add(const LabelValues& labels, double by) {
    if (kind_ == Kind::counter && !(by >= 0)) return;  // a counter never goes down
    std::lock_guard lock(mutex_);
    series(labels).value += by;
}

void MetricFamily::set(const LabelValues& labels, double value) {
    std::lock_guard lock(mutex_);
    series(labels).value = value;
}

void MetricFamily::observe(const LabelValues& labels, double value) {
    std::lock_guard lock(mutex_);
    Series& s = series(labels);
    const auto bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
    ++s.buckets[static_cast<std::size_t>(bucket)];
    s.sum += value;
    ++s.count;
}

void MetricFamily::clear() {
    std::lock_guard lock(mutex_);
    series_.clear();
}

void MetricFamily::replace(const std::map<LabelValues, double>& values) {
    std::lock_guard lock(mutex_);
    series_.clear();
    for (const auto& [labels, value] : values) series(labels).value = value;
}

void MetricFamily::render(std::string& out, MetricsFormat format) const {
    const bool om = format == MetricsFormat::openmetrics;
    const char* type = kind_ == Kind::counter ? "counter"
                       : kind_ == Kind::gauge ? "gauge"
                                              : "histogram";
    // 0.0.4 names a counter's family by its sample ("x_total"); OpenMetrics
    // names the family without the suffix its samples carry.
    const std::string family = kind_ == Kind::counter && !om ? name_ + "_total" : name_;
    const auto help_line = [&] {
        out += "# HELP ";
        out += family;
        out += ' ';
        append_help(out, help_, format);
        out += '\n';
    };
    if (!om) help_line();
    out += "# TYPE ";
    out += family;
    out += ' ';
    out += type;
    out += '\n';
    if (om) help_line();
    for (const auto& [labels, s] : series_) {
        switch (kind_) {
            case Kind::counter:
                append_sample(out, name_ + "_total", label_names_, labels, s.value);
                break;
            case Kind::gauge:
                append_sample(out, name_, label_names_, labels, s.value);
                break;
            case Kind::histogram: {
                std::uint64_t cumulative = 0;
                for (std::size_t i = 0; i <= bounds_.size(); ++i) {
                    cumulative += s.buckets[i];
                    const std::string le =
                        i < bounds_.size() ? metric_number(bounds_[i], true) : "+Inf";
                    append_sample(out, name_ + "_bucket", label_names_, labels,
                                  static_cast<double>(cumulative), le);
                }
                append_sample(out, name_ + "_sum", label_names_, labels, s.sum);
                append_sample(out, name_ + "_count", label_names_, labels,
                              static_cast<double>(s.count));
                break;
            }
        }
    }
}

MetricFamily& MetricsRegistry::add(MetricFamily::Kind kind, const std::string& name,
                                   const std::string& help, std::vector<std::string> label_names,
                                   std::vector<double> buckets) {
    if (!valid_name(name, false)) throw std::invalid_argument("metric name '" + name + "'");
    if (kind == MetricFamily::Kind::counter && name.ends_with("_total")) {
        throw std::invalid_argument("counter " + name + ": give the name without _total");
    }
    for (const auto& label : label_names) {
        if (!valid_name(label, true) || label == "le" || label == "quantile") {
            throw std::invalid_argument("metric " + name + ": label name '" + label + "'");
        }
    }
    for (std::size_t i = 0; i < buckets.size(); ++i) {
        if (!std::isfinite(buckets[i]) || (i > 0 && !(buckets[i] > buckets[i - 1]))) {
            throw std::invalid_argument("histogram " + name + ": buckets must ascend, finite");
        }
    }
    std::lock_guard lock(mutex_);
    for (const auto& f : families_) {
        if (f->name_ == name) throw std::invalid_argument("metric " + name + " registered twice");
    }
    families_.push_back(std::unique_ptr<MetricFamily>(
        new MetricFamily(mutex_, kind, name, help, std::move(label_names), std::move(buckets))));
    return *families_.back();
}

MetricFamily& MetricsRegistry::counter(const std::string& name, const std::string& help,
                                       std::vector<std::string> label_names) {
    return add(MetricFamily::Kind::counter, name, help, std::move(label_names), {});
}

MetricFamily& MetricsRegistry::gauge(const std::string& name, const std::string& help,
                                     std::vector<std::string> label_names) {
    return add(MetricFamily::Kind::gauge, name, help, std::move(label_names), {});
}

MetricFamily& MetricsRegistry::histogram(const std::string& name, const std::string& help,
                                         std::vector<std::string> label_names,
                                         std::vector<double> buckets) {
    return add(MetricFamily::Kind::histogram, name, help, std::move(label_names),
               std::move(buckets));
}

std::string MetricsRegistry::render(MetricsFormat format) const {
    std::string out;
    std::lock_guard lock(mutex_);
    for (const auto& f : families_) f->render(out, format);
    if (format == MetricsFormat::openmetrics) out += "# EOF\n";
    return out;
}

}  // namespace cellblock
