#include "moerl/core/metrics_registry.hpp"

#include <charconv>
#include <cmath>

#include "moerl/core/error.hpp"

namespace moerl {

namespace {

bool valid_metric_name(const std::string& name) {
    if (name.empty()) return false;
    for (size_t i = 0; i < name.size(); ++i) {
        const char c = name[i];
        const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
}

// HELP text: backslash and line feed escaped, as the exposition format requires.
std::string escape_help(const std::string& text) {
    std::string out;
    for (char c : text) {
        if (c == '\\')
            out += "\\\\";
        else if (c == '\n')
            out += "\\n";
        else
            out += c;
    }
    return out;
}

// Shortest text that reads back as the same double; the format's spellings of the special values.
std::string format_value(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

}  // namespace

MetricsRegistry::Entry& MetricsRegistry::add(const std::string& name, const std::string& help,
                                             const char* type) {
    MOERL_CHECK(valid_metric_name(name), "metric name '", name,
                "' is not valid; expected [a-zA-Z_:][a-zA-Z0-9_:]* (Prometheus)");
    auto [it, inserted] = entries_.try_emplace(name);
    Entry& e = it->second;
    if (inserted) {
        e.help = help;
        e.type = type;
    } else {
        MOERL_CHECK(std::string(e.type) == type && !e.read, "metric '", name, "' is already registered as a ",
                    e.read ? "computed gauge" : e.type, "; expected a ", type);
    }
    return e;
}

Counter& MetricsRegistry::counter(const std::string& name, const std::string& help) {
    std::lock_guard lock(mutex_);
    Entry& e = add(name, help, "counter");
    if (!e.counter) e.counter = std::make_unique<Counter>();
    return *e.counter;
}

Gauge& MetricsRegistry::gauge(const std::string& name, const std::string& help) {
    std::lock_guard lock(mutex_);
    Entry& e = add(name, help, "gauge");
    if (!e.gauge) e.gauge = std::make_unique<Gauge>();
    return *e.gauge;
}

void MetricsRegistry::gauge_fn(const std::string& name, const std::string& help,
                               std::function<double()> read) {
    MOERL_CHECK(read != nullptr, "metric '", name, "': computed gauge without a function");
    std::lock_guard lock(mutex_);
    MOERL_CHECK(entries_.count(name) == 0, "metric '", name, "' is already registered");
    Entry& e = add(name, help, "gauge");
    e.read = std::move(read);
}

double MetricsRegistry::read(const Entry& e) {
    if (e.counter) return e.counter->value();
    if (e.gauge) return e.gauge->value();
    try {
        return e.read();
    } catch (const std::exception&) {
        return NAN;
    }
}

std::optional<double> MetricsRegistry::value(const std::string& name) const {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return read(it->second);
}

std::string MetricsRegistry::exposition() const {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& [name, e] : entries_) {
        const double v = read(e);
        if (e.read && std::isnan(v)) continue;  // no sample beats a made-up one
        out += "# HELP " + name + " " + escape_help(e.help) + "\n";
        out += "# TYPE " + name + " " + e.type + "\n";
        out += name + " " + format_value(v) + "\n";
    }
    return out;
}

}  // namespace moerl
