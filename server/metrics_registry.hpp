// Counters, gauges and histograms with label sets, and their text: the
// Prometheus exposition format 0.0.4 or OpenMetrics 1.0. A value with a
// mutex: the server's loop updates it, the metrics endpoint's thread renders
// it (tests/unit/metrics_registry_test.cpp checks the text exactly).
//
// Families are registered once, with their label names; a series is made on
// its first update. Callers keep label values bounded (an image, a reason
// from a fixed set, a catalogue ename), never a session id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock {

enum class MetricsFormat {
    prometheus_text,  // text/plain; version=0.0.4
    openmetrics,      // application/openmetrics-text; version=1.0.0
};

// The Content-Type of a scrape in `format`.
std::string_view metrics_content_type(MetricsFormat format);

using LabelValues = std::vector<std::string>;

class MetricsRegistry;

class MetricFamily {
  public:
    enum class Kind { counter, gauge, histogram };
    MetricFamily(const MetricFamily&) = delete;
    MetricFamily& operator=(const MetricFamily&) = delete;

    // Counter: adds `by` (>= 0). Gauge: adds `by` (any sign).
    void add(const LabelValues& labels, double by = 1);
    // Gauge: sets. Counter: sets a total counted elsewhere (the kernel's CPU time).
    void set(const LabelValues& labels, double value);
    // Histogram: counts one observation.
    void observe(const LabelValues& labels, double value);
    // Drops every series.
    void clear();
    // Gauge: every series at once, from a snapshot; a scrape sees the old
    // set or the new one, never a half.
    void replace(const std::map<LabelValues, double>& values);

    const std::string& name() const { return name_; }
    Kind kind() const { return kind_; }

  private:
    friend class MetricsRegistry;
    struct Series {
        double value = 0;                    // counter, gauge
        std::vector<std::uint64_t> buckets;  // histogram: per bucket, not cumulative
        double sum = 0;
        std::uint64_t count = 0;
    };
    MetricFamily(std::mutex& mutex, Kind kind, std::string name, std::string help,
                 std::vector<std::string> label_names, std::vector<double> buckets);
    Series& series(const LabelValues& labels);  // under mutex_
    void render(std::string& out, MetricsFormat format) const;

    std::mutex& mutex_;
    Kind kind_;
    std::string name_;  // a counter's without "_total"
    std::string help_;
    std::vector<std::string> label_names_;
    std::vector<double> bounds_;  // histogram: upper bounds, ascending, +Inf implied
    std::map<LabelValues, Series> series_;
};

class MetricsRegistry {
  public:
    MetricsRegistry() = default;
    MetricsRegistry(const MetricsRegistry&) = delete;
    MetricsRegistry& operator=(const MetricsRegistry&) = delete;

    // `name` of a counter is given without "_total": the text adds it where
    // each format wants it. Throws std::invalid_argument on an invalid or
    // taken name, or a label name that is invalid or reserved ("le").
    MetricFamily& counter(const std::string& name, const std::string& help,
                          std::vector<std::string> label_names = {});
    MetricFamily& gauge(const std::string& name, const std::string& help,
                        std::vector<std::string> label_names = {});
    // `buckets`: upper bounds, strictly ascending, finite; +Inf is added.
    MetricFamily& histogram(const std::string& name, const std::string& help,
                            std::vector<std::string> label_names, std::vector<double> buckets);

    // Every family in registration order; OpenMetrics ends with "# EOF".
    std::string render(MetricsFormat format) const;

  private:
    MetricFamily& add(MetricFamily::Kind kind, const std::string& name, const std::string& help,
                      std::vector<std::string> label_names, std::vector<double> buckets);
    mutable std::mutex mutex_;
    std::vector<std::unique_ptr<MetricFamily>> families_;
};

// A number as both formats write it: shortest round trip, "+Inf", "-Inf",
// "NaN"; `force_float` adds ".0" to an integral value (histogram bounds).
std::string metric_number(double value, bool force_float = false);

}  // namespace cellblock
