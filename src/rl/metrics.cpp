#include "moerl/rl/metrics.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moerl/core/error.hpp"

namespace moerl::rl {

namespace {
// Text as XML character data or an attribute value.
std::string xml_escape(const std::string& text) {
    std::string out;
    for (char ch : text) {
        switch (ch) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            case '\'':
                out += "&apos;";
                break;
            default:
                if (static_cast<unsigned char>(ch) >= 0x20 || ch == '\t')
                    out += ch;  // XML 1.0 has no other controls
        }
    }
    return out;
}
}  // namespace

void write_reward_svg(const std::string& path, const std::vector<double>& steps,
                      const std::vector<double>& values, const std::string& title) {
    const double W = 720, H = 400, left = 60, right = 20, top = 40, bottom = 50;
    const double pw = W - left - right, ph = H - top - bottom;
    double x0 = steps.empty() ? 0 : steps.front(), x1 = steps.empty() ? 1 : steps.back();
    if (x1 <= x0) x1 = x0 + 1;
    auto X = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
    auto Y = [&](double y) { return top + (1.0 - std::clamp(y, 0.0, 1.0)) * ph; };
    std::ostringstream s;
    char buf[128];
    s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
         "fill=\"white\"/>\n";
    s << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << xml_escape(title)
      << "</text>\n";
    for (int i = 0; i <= 5; ++i) {
        double y = i / 5.0;
        std::snprintf(buf, sizeof buf, "%.1f", y);
        s << "<line x1=\"" << left << "\" x2=\"" << W - right << "\" y1=\"" << Y(y) << "\" y2=\"" << Y(y)
          << "\" stroke=\"#ddd\"/><text x=\"" << left - 8 << "\" y=\"" << Y(y) + 4
          << "\" text-anchor=\"end\">" << buf << "</text>\n";
    }
    for (int i = 0; i <= 5; ++i) {
        double x = x0 + (x1 - x0) * i / 5.0;
        std::snprintf(buf, sizeof buf, "%.0f", x);
        s << "<text x=\"" << X(x) << "\" y=\"" << H - bottom + 18 << "\" text-anchor=\"middle\">" << buf
          << "</text>\n";
    }
    s << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 10
      << "\" text-anchor=\"middle\">training step</text>\n";
    s << "<text x=\"16\" y=\"" << top + ph / 2 << "\" transform=\"rotate(-90 16 " << top + ph / 2
      << ")\" text-anchor=\"middle\">mean reward</text>\n";
    s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#444\"/>\n";
    auto polyline = [&](const std::vector<double>& v, const char* color, double width) {
        s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"" << width << "\" points=\"";
        for (size_t i = 0; i < v.size(); ++i) {
            std::snprintf(buf, sizeof buf, "%.1f,%.1f ", X(steps[i]), Y(v[i]));
            s << buf;
        }
        s << "\"/>\n";
    };
    std::vector<double> avg(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
        size_t from = i >= 9 ? i - 9 : 0;
        double sum = 0;
        for (size_t j = from; j <= i; ++j) sum += values[j];
        avg[i] = sum / static_cast<double>(i - from + 1);
    }
    polyline(values, "#9ecae1", 1);
    polyline(avg, "#08519c", 2.5);
    s << "<text x=\"" << W - right - 4 << "\" y=\"" << top + 16
      << "\" text-anchor=\"end\" fill=\"#08519c\">per step (light), 10-step mean (dark)</text>\n</svg>\n";
    std::ofstream out(path);
    MOERL_CHECK(out, "cannot write ", path);
    out << s.str();
}

void truncate_metrics(const std::string& path, long long next_step) {
    if (!std::filesystem::exists(path)) return;
    std::ifstream in(path);
    std::string line, kept;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.contains("step")) continue;
        if (j["step"].get<long long>() < next_step) kept += line + "\n";
    }
    in.close();
    std::ofstream(path, std::ios::trunc) << kept;
}

}  // namespace moerl::rl
