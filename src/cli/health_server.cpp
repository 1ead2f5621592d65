#include "health_server.hpp"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>

#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"

namespace moerl::cli {

namespace {
constexpr const char* kExpositionType = "text/plain; version=0.0.4; charset=utf-8";
}  // namespace

HealthOptions HealthOptions::from_env() {
    HealthOptions o;
    o.host = env::get_string("MOERL_HEALTH_ADDR", o.host);
    o.port = static_cast<int>(env::get_int("MOERL_HEALTH_PORT", o.port));
    o.validate();
    return o;
}

void HealthOptions::validate() const {
    MOERL_CHECK(!host.empty(), "health server address is empty; expected an address such as 0.0.0.0");
    MOERL_CHECK(port >= 0 && port <= 65535, "health server port ", port,
                " (MOERL_HEALTH_PORT) is out of range; expected 0..65535 (0: any free port)");
    MOERL_CHECK(threads >= 1 && threads <= 64, "health server threads ", threads, "; expected 1..64");
}

struct HealthServer::Impl {
    httplib::Server server;
    std::atomic<bool> listen_returned{false};
};

HealthServer::HealthServer(const HealthOptions& options, const MetricsRegistry& metrics, ReadyCheck ready)
    : impl_(std::make_unique<Impl>()) {
    options.validate();
    httplib::Server& s = impl_->server;
    const int threads = options.threads;
    s.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    // httplib's default sets SO_REUSEPORT, which lets a second process share the port silently;
    // SO_REUSEADDR alone allows a quick restart and makes a busy port an error.
    s.set_socket_options([](socket_t sock) {
        int yes = 1;
        ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    s.set_read_timeout(5, 0);
    s.set_write_timeout(5, 0);
    s.Get("/healthz",
          [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
    s.Get("/readyz", [ready](const httplib::Request&, httplib::Response& res) {
        std::string why;
        bool ok = false;
        try {
            ok = !ready || ready(why);
        } catch (const std::exception& e) {
            why = e.what();
        }
        res.status = ok ? 200 : 503;
        res.set_content(ok ? std::string("ready\n") : "not ready: " + why + "\n", "text/plain");
    });
    s.Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& res) {
        res.set_content(metrics.exposition(), kExpositionType);
    });

    if (options.port == 0) {
        port_ = s.bind_to_any_port(options.host);
    } else {
        port_ = s.bind_to_port(options.host, options.port) ? options.port : -1;
    }
    MOERL_CHECK(port_ > 0, "health server: cannot listen on ", options.host, ":", options.port,
                " (address in use, or not an address of this host?); set MOERL_HEALTH_PORT to a free port");
    thread_ = std::thread([this] {
        impl_->server.listen_after_bind();
        impl_->listen_returned.store(true);
    });
}

HealthServer::~HealthServer() {
    // stop() does nothing before the accept loop runs: wait for it, or for its end.
    while (!impl_->server.is_running() && !impl_->listen_returned.load())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    impl_->server.stop();
    if (thread_.joinable()) thread_.join();
}

}  // namespace moerl::cli
