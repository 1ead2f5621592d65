// Continuous-batching generation on top of MoeModel's prefill/decode. The active batch shares one
// KV cache; joining sequences are prefilled in their own cache and merged in, right-aligned (the
// model's positions come from next_position, so leading empty columns are harmless). On a CUDA
// device model::Generator holds the sequences instead (a slot each in its paged cache) and runs
// prefill and the decode steps, routing records included.
//
// Over processes, every rank runs this on its own sequences and rank 0 schedules: each step it
// broadcasts which new requests each rank admits and whether anyone prefills or decodes, so every
// rank runs the same forwards (a rank with nothing to compute joins the MoE layers' collectives
// empty-handed), then gathers what finished.
#include "moerl/rl/rollout.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "group_admission.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"
#include "moerl/model/generator.hpp"
#include "moerl/model/model.hpp"
#include "rank_group.hpp"

namespace moerl::rl {

namespace {

// A rank's counts so far: tokens sampled, context tokens prefilled, and of them shared.
struct RankCounts {
    int64_t tokens = 0, prompt_tokens = 0, prompt_tokens_shared = 0;
};

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

// Merges b's sequences after a's, aligning both to the right; `room` columns are left free.
model::KvCache merge_caches(model::KvCache& a, model::KvCache& b, int64_t room) {
    if (a.batch_size() == 0) return std::move(b);
    auto used_span = [](const model::KvCache& c) {
        // Leading columns no sequence uses can be dropped.
        at::Tensor any = c.key_valid.narrow(1, 0, c.length).any(0);
        int64_t first = 0;
        auto acc = any.accessor<bool, 1>();
        while (first < c.length && !acc[first]) ++first;
        return std::make_pair(first, c.length - first);
    };
    auto [a0, an] = used_span(a);
    auto [b0, bn] = used_span(b);
    const int64_t L = std::max(an, bn), Ba = a.batch_size(), Bb = b.batch_size();
    model::KvCache out;
    out.capacity = L + room;
    out.length = L;
    auto place = [&](const at::Tensor& src_a, const at::Tensor& src_b, at::Tensor proto) {
        std::vector<int64_t> shape(proto.sizes().begin(), proto.sizes().end());
        shape[0] = Ba + Bb;
        const int col = proto.dim() == 4 ? 2 : 1;
        shape[col] = out.capacity;
        at::Tensor t = at::zeros(shape, proto.options());
        t.narrow(0, 0, Ba).narrow(col, L - an, an).copy_(src_a.narrow(col, a0, an));
        t.narrow(0, Ba, Bb).narrow(col, L - bn, bn).copy_(src_b.narrow(col, b0, bn));
        return t;
    };
    for (size_t l = 0; l < a.keys.size(); ++l) {
        out.keys.push_back(place(a.keys[l], b.keys[l], a.keys[l]));
        out.values.push_back(place(a.values[l], b.values[l], a.values[l]));
    }
    out.key_valid = place(a.key_valid, b.key_valid, a.key_valid);
    out.next_position = at::cat({a.next_position, b.next_position});
    return out;
}

}  // namespace

namespace detail {

size_t same_context_run(const std::deque<GenRequest>& q, size_t from) {
    size_t i = from + 1;
    while (i < q.size() && q[i].prompt == q[from].prompt && q[i].prefix.tokens == q[from].prefix.tokens) ++i;
    return i - from;
}

size_t whole_groups(const std::deque<GenRequest>& q, size_t room, size_t max_batch, bool idle, bool share) {
    if (!share) return std::min(q.size(), room);
    size_t n = 0;
    while (n < q.size() && n < room) {
        const size_t run = same_context_run(q, n);
        if (n + run <= room) {
            n += run;
        } else if (run > max_batch || (idle && n == 0)) {
            return room;
        } else {
            break;
        }
    }
    return n;
}

}  // namespace detail

double uniform_draw(uint64_t seed, uint64_t draw) {
    return static_cast<double>(splitmix64(splitmix64(seed) ^ (draw * 0xD1B54A32D192ED03ULL)) >> 11) *
           0x1.0p-53;
}

at::Tensor allowed_token_bias(const SamplingParams& p, int64_t V, const at::TensorOptions& options) {
    if (p.allowed_tokens.empty()) return {};
    std::vector<int64_t> ids(p.allowed_tokens.begin(), p.allowed_tokens.end());
    ids.insert(ids.end(), p.stop_tokens.begin(), p.stop_tokens.end());
    // Finite, so that the trainer's masked prompt positions stay 0 (not -inf x 0).
    at::Tensor bias = at::full({V}, -1e9, options);
    return bias.index_fill_(0, at::tensor(ids, at::kLong).to(options.device()), 0.0);
}

std::vector<std::pair<int, float>> sample_tokens(const at::Tensor& logits, const SamplingParams& p,
                                                 const std::vector<double>& uniforms) {
    MOERL_CHECK(logits.dim() == 2, "sample_tokens: logits must be [rows, vocab], got ", logits.dim(),
                " dims");
    const int64_t B = logits.size(0), V = logits.size(1);
    MOERL_CHECK(static_cast<int64_t>(uniforms.size()) == B, "sample_tokens: ", uniforms.size(),
                " uniform draws for ", B, " rows");
    if (B == 0) return {};
    MOERL_CHECK(V >= 1, "sample_tokens: empty vocabulary");
    c10::NoGradGuard no_grad;
    std::vector<std::pair<int, float>> out(B);
    const bool untruncated = (p.top_k <= 0 || p.top_k >= V) && p.top_p >= 1.0 && p.allowed_tokens.empty();
    if (untruncated && logits.is_cuda() && model::Generator::available() && logits.stride(1) == 1 &&
        (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat)) {
        // The whole distribution on a GPU: one kernel, no sort (the rollout engine's default).
        const at::Tensor drawn = model::sample_on_device(logits.detach(), uniforms, p.temperature);
        const double* d = drawn.data_ptr<double>();
        for (int64_t i = 0; i < B; ++i) out[i] = {static_cast<int>(d[i]), static_cast<float>(d[B + i])};
        return out;
    }
    // In double on the logits' device: tempered log-probabilities.
    at::Tensor z = logits.detach().to(at::kDouble) / p.temperature;
    const at::Tensor u = at::tensor(uniforms, at::kDouble).to(z.device()).unsqueeze(1);
    auto emit = [&](const at::Tensor& token, const at::Tensor& logprob) {
        const at::Tensor tokens = token.squeeze(1).to(at::kCPU, at::kLong).contiguous();
        const at::Tensor logprobs = logprob.squeeze(1).to(at::kCPU).contiguous();
        const int64_t* tok = tokens.data_ptr<int64_t>();
        const double* lp = logprobs.data_ptr<double>();
        for (int64_t i = 0; i < B; ++i) out[i] = {static_cast<int>(tok[i]), static_cast<float>(lp[i])};
        return out;
    };
    if (untruncated) {
        // Inverse CDF in vocabulary order: the first token whose running mass exceeds u.
        const at::Tensor log_norm = at::logsumexp(z, 1, /*keepdim=*/true);
        const at::Tensor mass = at::cumsum(at::exp(z - log_norm), 1);
        const at::Tensor target = u * mass.narrow(1, V - 1, 1);
        const at::Tensor pick = at::clamp_max((mass <= target).sum(1, true), V - 1);
        return emit(pick, z.gather(1, pick) - log_norm);
    }
    // Truncated: sorted (stable) most likely first.
    if (at::Tensor bias = allowed_token_bias(p, V, z.options()); bias.defined()) z = z + bias;
    const at::Tensor log_norm = at::logsumexp(z, 1, /*keepdim=*/true);
    auto [sorted, order] = at::sort(z, /*stable=*/true, /*dim=*/1, /*descending=*/true);
    const at::Tensor mass = at::cumsum(at::exp(sorted - log_norm), 1);  // mass of the i most likely + 1
    // Kept: the top_k most likely, then as few as reach top_p of the mass.
    const int64_t top_k = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
    at::Tensor keep = at::full({B, 1}, top_k, order.options());
    if (p.top_p < 1.0) keep = at::minimum(keep, (mass.narrow(1, 0, top_k) < p.top_p).sum(1, true) + 1);
    // Inverse CDF over the kept mass in that order: the first token whose running mass exceeds u * kept.
    const at::Tensor target = u * mass.gather(1, keep - 1);
    const at::Tensor pick = at::minimum((mass <= target).sum(1, true), keep - 1);
    return emit(order.gather(1, pick), sorted.gather(1, pick) - log_norm);
}

std::pair<int, float> sample_token(const float* logits, int V, const SamplingParams& p, double u) {
    const at::Tensor row = at::from_blob(const_cast<float*>(logits), {1, V}, at::kFloat);
    return sample_tokens(row, p, {u})[0];
}

struct RolloutEngine::Impl {
    struct Seq {
        GenRequest req;
        Trajectory traj;
        int next_input = -1;    // last sampled token, not yet in the cache
        int slot = -1;          // the Generator's slot (CUDA engine)
        bool finished = false;  // returned already; its row of a queued step is dropped
    };
    const model::MoeModel& model;
    SamplingParams params;
    int max_batch;
    bool record_routing;
    int num_moe_layers, top_k, vocab;
    std::deque<GenRequest> waiting;
    std::vector<Seq> active;  // row i of the cache
    model::KvCache cache;
    std::unique_ptr<model::Generator> gen;  // the CUDA engine, when it runs the sequences
    int max_seq_len = 0;
    // Chunked prefill (the CUDA engine in one process; 0 = off): context tokens prefilled a step.
    // A joining group's identical contexts are prefilled once, into seqs[0]'s slot, in parts; the
    // others fork from it once the context is whole. Their slots are taken when the group joins.
    int64_t prefill_chunk_tokens = 0;
    struct JoiningGroup {
        std::vector<Seq> seqs;
        std::vector<int64_t> context;  // prompt + resumed response
        int64_t prefilled = 0;         // tokens of context in seqs[0]'s slot so far
    };
    std::deque<JoiningGroup> joining;
    int64_t tokens = 0;
    int64_t prompt_tokens = 0, prompt_tokens_shared = 0;  // prefilled contexts; of them from a group-mate
    // One process, untruncated sampling: decode steps queued one ahead of the host (step_queued).
    bool queue_ahead = false;
    std::deque<int64_t> queued_versions;  // the policy version of each queued step, oldest first
    // The CUDA engine's decode steps: wall seconds, their dense bytes (summed on the host as each
    // step's row count is known) and how many (the routed experts and KV cache come from gen->stats()).
    double decode_seconds = 0, decode_dense_bytes = 0;
    int64_t decode_steps = 0;
    // decode_traffic() as of its last call: asking again before another step needs no device read.
    mutable DecodeTraffic traffic;
    RankCounts counts() const { return {tokens, prompt_tokens, prompt_tokens_shared}; }

    // Over processes on a GPU: the decode steps' low-latency EP buffer (the model's own serves the
    // prefill).
    std::unique_ptr<ep::C10dStore> decode_store;
    std::unique_ptr<ep::Buffer> decode_ep;

    // procs: the processes of an engine spread over several (nullptr in one process).
    Impl(const model::MoeModel& m, const SamplingParams& p, const RolloutEngineOptions& eo,
         const RoleProcesses* procs)
        : model(m),
          params(p),
          max_batch(eo.max_batch),
          record_routing(eo.record_routing),
          max_seq_len(eo.max_seq_len),
          prefill_chunk_tokens(procs == nullptr ? eo.prefill_chunk_tokens : 0) {
        num_moe_layers = m.config().num_moe_layers();
        top_k = m.config().num_experts_per_tok;
        vocab = m.config().vocab_size;
        if (!m.options().device.is_cuda() || !model::Generator::available()) return;
        model::GeneratorOptions o;
        o.max_batch = max_batch;
        o.max_seq_len = max_seq_len;
        o.record_routing = record_routing;
        o.fp8_weights = eo.fp8_weights;
        o.fp8_kv_cache = eo.fp8_kv_cache;
        o.cuda_graphs = eo.cuda_graphs;
        if (const ep::Buffer* prefill = m.options().ep; prefill != nullptr) {
            if (procs == nullptr || !prefill->on_device()) return;  // the model's eager steps
            ep::Config c = prefill->config();
            c.max_tokens_per_rank = max_batch;
            c.low_latency = true;
            c.job_id = "rollout-decode";
            decode_store = std::make_unique<ep::C10dStore>(
                c10::make_intrusive<c10d::PrefixStore>("rollout-decode-ep", procs->store));
            decode_ep = std::make_unique<ep::Buffer>(c, decode_store.get());
            o.ep = decode_ep.get();
        }
        gen = std::make_unique<model::Generator>(m, o);
        queue_ahead = procs == nullptr && untruncated() &&
                      (m.options().dtype == at::kBFloat16 || m.options().dtype == at::kFloat);
    }

    // Sampling that the device kernel draws (no top-k, top-p or allowed-token set).
    bool untruncated() const {
        return (params.top_k <= 0 || params.top_k >= vocab) && params.top_p >= 1.0 &&
               params.allowed_tokens.empty();
    }

    ~Impl() {
        if (abandoned) {
            // A rank is gone: the EP buffer's teardown is collective, and the generator's waits for
            // the device, where a step may still wait for that rank. Both are left to the process's end.
            (void)gen.release();
            (void)decode_ep.release();
            return;
        }
        gen.reset();
    }
    bool abandoned = false;

    // A rank with nothing to decode while the others decode.
    void idle_decode() {
        if (gen) {
            gen->idle_step();
        } else {
            model.idle_pass();
        }
    }

    // Whether a group's samples admitted together share their prompt's cache blocks.
    bool shares_prompts() const { return gen != nullptr; }

    // The Generator's slots of finished sequences go back (the eager path keeps its cache rows).
    void release(Seq& s) {
        if (gen && s.slot >= 0) gen->release(s.slot);
        s.slot = -1;
    }

    size_t route_width() const { return static_cast<size_t>(num_moe_layers) * top_k; }

    // The routing records of a batch [n, S, M, K] (any device and integer type) as one host int16 copy,
    // so that each row's part is appended by pointer (no tensor operation a row: a decode step of
    // 128 rows made ~0.6 ms of them).
    static at::Tensor host_routing(const at::Tensor& r) { return r.to(at::kCPU, at::kShort).contiguous(); }

    // Appends row `row` of host_routing() from column first_col on.
    void append_routing(Seq& s, const at::Tensor& all, int64_t row, int64_t first_col) {
        if (!record_routing) return;
        const int64_t S = all.size(1), width = all.numel() / std::max<int64_t>(1, all.size(0) * S);
        const int16_t* p = all.data_ptr<int16_t>() + (row * S + first_col) * width;
        s.traj.routing.insert(s.traj.routing.end(), p, p + (S - first_col) * width);
    }

    // Draws the next token of each sequence in `rows` from the matching row of logits [rows, V].
    std::vector<std::pair<int, float>> draw(const std::vector<Seq*>& rows, const at::Tensor& logits) {
        std::vector<double> u;
        for (Seq* s : rows) u.push_back(uniform_draw(s->req.seed, s->traj.rng_draws++));
        return sample_tokens(logits, params, u);
    }

    // Appends a sampled token to s; returns true when s is finished.
    bool take(Seq& s, int tok, float lp, int64_t version) {
        s.traj.tokens.push_back(tok);
        s.traj.logprobs.push_back(lp);
        s.traj.versions.push_back(version);
        ++tokens;
        s.next_input = tok;
        if (std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) !=
            params.stop_tokens.end()) {
            s.traj.terminated = true;
            return true;
        }
        return static_cast<int>(s.traj.tokens.size()) >= s.req.max_new_tokens;
    }

    GenResult finish(Seq& s) {
        if (record_routing) {
            // The last sampled token was never fed to the model: its experts are unknown.
            const size_t want = (s.req.prompt.size() + s.traj.tokens.size()) * route_width();
            s.traj.routing.resize(want, -1);
        }
        return {s.req.id, std::move(s.traj)};
    }

    void keep_rows(const std::vector<int64_t>& rows) {
        std::vector<Seq> kept;
        for (int64_t r : rows) kept.push_back(std::move(active[r]));
        active = std::move(kept);
        if (gen) return;
        if (active.empty()) {
            cache = model::KvCache();
        } else {
            cache.select(at::tensor(rows, at::kLong));
        }
    }

    // The next waiting request as a sequence (its routing recomputed by its prefill).
    Seq next_waiting() {
        Seq s;
        s.req = std::move(waiting.front());
        waiting.pop_front();
        s.traj = s.req.prefix;
        s.traj.num_moe_layers = num_moe_layers;
        s.traj.top_k = top_k;
        s.traj.routing.clear();
        return s;
    }

    static std::vector<int64_t> context_of(const Seq& s) {
        std::vector<int64_t> ctx(s.req.prompt.begin(), s.req.prompt.end());
        ctx.insert(ctx.end(), s.traj.tokens.begin(), s.traj.tokens.end());
        return ctx;
    }

    // Sequences holding a slot: decoding, or joining (chunked prefill).
    size_t held() const {
        size_t n = active.size();
        for (const JoiningGroup& j : joining) n += j.seqs.size();
        return n;
    }

    // Waiting requests admit() takes while `in_use` slots are held: the whole groups that fit.
    size_t admissible(size_t in_use) const {
        const int64_t room = std::max<int64_t>(0, max_batch - static_cast<int64_t>(in_use));
        return detail::whole_groups(waiting, static_cast<size_t>(room), static_cast<size_t>(max_batch),
                                    in_use == 0, shares_prompts());
    }

    // Each sequence draws its first token from its row of logits [rows, V] (rows[i] for seqs[i]);
    // those that finish leave (done), the others join `active`, in order. Returns the indices into
    // seqs of those that joined.
    std::vector<int64_t> start_decoding(std::vector<Seq*> seqs, const std::vector<int64_t>& rows,
                                        const at::Tensor& logits, int64_t version,
                                        std::vector<GenResult>& done) {
        std::vector<Seq*> drawing;
        std::vector<int64_t> drawing_rows;
        for (size_t i = 0; i < seqs.size(); ++i)
            if (static_cast<int>(seqs[i]->traj.tokens.size()) < seqs[i]->req.max_new_tokens) {
                drawing.push_back(seqs[i]);
                drawing_rows.push_back(rows[i]);
            }
        std::vector<std::pair<int, float>> tokens;
        if (!drawing.empty())
            tokens = draw(drawing,
                          logits.index_select(0, at::tensor(drawing_rows, at::kLong).to(logits.device())));
        std::vector<int64_t> kept;
        for (size_t i = 0, d = 0; i < seqs.size(); ++i) {
            Seq& s = *seqs[i];
            bool finished = true;
            if (d < drawing.size() && drawing[d] == &s) {
                finished = take(s, tokens[d].first, tokens[d].second, version);
                ++d;
            }
            if (finished) {
                release(s);
                done.push_back(finish(s));
            } else {
                active.push_back(std::move(s));
                kept.push_back(static_cast<int64_t>(i));
            }
        }
        return kept;
    }

    // Chunked prefill: whole groups join while slots are free; then at most prefill_chunk_tokens of
    // the joining contexts, oldest first, go through one prefill call. A group whose context is now
    // whole forks it into its other samples, and all of them draw their first token.
    void admit_in_parts(int64_t version, std::vector<GenResult>& done) {
        const size_t n = admissible(held());
        for (size_t taken = 0; taken < n;) {
            const size_t run = std::min(n - taken, detail::same_context_run(waiting, 0));
            JoiningGroup j;
            for (size_t k = 0; k < run; ++k) {
                j.seqs.push_back(next_waiting());
                j.seqs.back().slot = gen->acquire();
                MOERL_CHECK(j.seqs.back().slot >= 0, "rollout: the CUDA engine has no free slot for request ",
                            j.seqs.back().req.id);
            }
            j.context = context_of(j.seqs[0]);
            prompt_tokens += static_cast<int64_t>(run * j.context.size());
            joining.push_back(std::move(j));
            taken += run;
        }
        if (joining.empty()) return;
        std::vector<int> slots;
        std::vector<std::vector<int64_t>> parts;
        int64_t budget = prefill_chunk_tokens;
        for (JoiningGroup& j : joining) {
            if (budget <= 0) break;
            const int64_t take =
                std::min<int64_t>(budget, static_cast<int64_t>(j.context.size()) - j.prefilled);
            slots.push_back(j.seqs[0].slot);
            parts.emplace_back(j.context.begin() + j.prefilled, j.context.begin() + j.prefilled + take);
            budget -= take;
        }
        model::GenerationStep out = gen->prefill(slots, parts);
        const at::Tensor routing = record_routing ? host_routing(out.routing) : at::Tensor();
        // Whole contexts end a prefix of the queue: a group gets a part only when every older one
        // got the rest of its context.
        std::vector<Seq*> starting;
        std::vector<int64_t> rows;
        size_t whole = 0;
        for (size_t r = 0; r < parts.size(); ++r) {
            JoiningGroup& j = joining[r];
            const int64_t len = static_cast<int64_t>(parts[r].size());
            if (record_routing)
                append_routing(j.seqs[0], routing, static_cast<int64_t>(r), routing.size(1) - len);
            j.prefilled += len;
            if (j.prefilled < static_cast<int64_t>(j.context.size())) continue;
            for (size_t k = 1; k < j.seqs.size(); ++k) {
                gen->fork(j.seqs[0].slot, j.seqs[k].slot);
                j.seqs[k].traj.routing = j.seqs[0].traj.routing;
                prompt_tokens_shared += static_cast<int64_t>(j.context.size());
            }
            for (Seq& s : j.seqs) {
                starting.push_back(&s);
                rows.push_back(static_cast<int64_t>(r));
            }
            ++whole;
        }
        if (starting.empty()) return;
        start_decoding(starting, rows, out.logits, version, done);
        joining.erase(joining.begin(), joining.begin() + static_cast<std::ptrdiff_t>(whole));
    }

    // prefill_pass: another rank of the engine prefills now (this one joins the collectives).
    void admit(int64_t version, std::vector<GenResult>& done, bool prefill_pass) {
        if (gen && prefill_chunk_tokens > 0) return admit_in_parts(version, done);
        const size_t n = admissible(active.size());
        if (n == 0) {
            if (prefill_pass) model.idle_pass();
            return;
        }
        std::vector<Seq> joining;
        std::vector<std::vector<int64_t>> contexts;  // prompt + resumed response
        int64_t longest = 0;
        for (size_t i = 0; i < n; ++i) {
            joining.push_back(next_waiting());
            contexts.push_back(context_of(joining.back()));
            longest = std::max<int64_t>(longest, static_cast<int64_t>(contexts.back().size()));
            prompt_tokens += static_cast<int64_t>(contexts.back().size());
        }
        at::Tensor logits;  // [n, V]: each joining sequence's next-token logits
        model::KvCache fresh;
        int64_t room = 0;
        if (gen) {
            std::vector<int> slots;
            for (Seq& s : joining) {
                s.slot = gen->acquire();
                MOERL_CHECK(s.slot >= 0, "rollout: the CUDA engine has no free slot for request ", s.req.id);
                slots.push_back(s.slot);
            }
            model::GenerationStep out = gen->prefill(slots, contexts);
            prompt_tokens_shared += out.shared_tokens;
            logits = out.logits;
            if (record_routing) {
                const at::Tensor routing = host_routing(out.routing);
                for (size_t i = 0; i < n; ++i)
                    append_routing(joining[i], routing, static_cast<int64_t>(i),
                                   longest - static_cast<int64_t>(contexts[i].size()));
            }
        } else {
            const int64_t B = static_cast<int64_t>(n);
            at::Tensor ids = at::zeros({B, longest}, at::kLong);
            at::Tensor mask = at::zeros({B, longest}, at::kLong);
            std::vector<int64_t> pad(n);
            for (size_t i = 0; i < n; ++i) {
                const int64_t len = static_cast<int64_t>(contexts[i].size());
                pad[i] = longest - len;
                ids[i].narrow(0, pad[i], len).copy_(at::tensor(contexts[i], at::kLong));
                mask[i].narrow(0, pad[i], len).fill_(1);
            }
            for (auto& s : joining)
                room = std::max<int64_t>(room, s.req.max_new_tokens - (int64_t)s.traj.tokens.size());
            for (auto& s : active)
                room = std::max<int64_t>(room, s.req.max_new_tokens - (int64_t)s.traj.tokens.size());
            fresh = model.new_cache(B, longest + room + 1);
            model::StepOutput out = model.prefill(fresh, ids, mask, record_routing);
            if (record_routing) {
                const at::Tensor routing = host_routing(out.routing);
                for (size_t i = 0; i < n; ++i)
                    append_routing(joining[i], routing, static_cast<int64_t>(i), pad[i]);
            }
            logits = out.logits;
        }
        std::vector<Seq*> seqs;
        std::vector<int64_t> rows;
        for (size_t i = 0; i < n; ++i) {
            seqs.push_back(&joining[i]);
            rows.push_back(static_cast<int64_t>(i));
        }
        const std::vector<int64_t> keep = start_decoding(seqs, rows, logits, version, done);
        if (keep.empty()) return;
        if (!gen && keep.size() < n) fresh.select(at::tensor(keep, at::kLong));
        if (!gen) cache = merge_caches(cache, fresh, room + 1);
    }

    // prefill_pass / decode_pass: another rank of the engine prefills / decodes in this step.
    std::vector<GenResult> step(int64_t version, bool prefill_pass = false, bool decode_pass = false) {
        if (queue_ahead) return step_queued(version);
        c10::NoGradGuard no_grad;
        std::vector<GenResult> done;
        admit(version, done, prefill_pass);
        if (active.empty()) {
            if (decode_pass) idle_decode();
            return done;
        }
        std::vector<int64_t> in;
        std::vector<int> slots;
        for (auto& s : active) in.push_back(s.next_input), slots.push_back(s.slot);
        model::StepOutput out;
        const auto decode_t0 = std::chrono::steady_clock::now();
        if (gen) {
            decode_dense_bytes +=
                static_cast<double>(gen->dense_bytes_per_step(static_cast<int>(slots.size())));
            ++decode_steps;
            model::GenerationStep g = gen->decode(slots, at::tensor(in, at::kLong));
            out.logits = g.logits;
            // [n, M, K] -> [n, 1, M, K]: one column per row, as the eager decode gives.
            if (record_routing) out.routing = g.routing.unsqueeze(1);
        } else
            out = model.decode(cache, at::tensor(in, at::kLong), record_routing);
        std::vector<Seq*> rows;
        for (auto& s : active) rows.push_back(&s);
        const std::vector<std::pair<int, float>> tokens = draw(rows, out.logits);
        const at::Tensor routing = record_routing ? host_routing(out.routing) : at::Tensor();
        std::vector<int64_t> keep;
        for (size_t i = 0; i < active.size(); ++i) {
            Seq& s = active[i];
            if (record_routing) append_routing(s, routing, static_cast<int64_t>(i), 0);
            if (take(s, tokens[i].first, tokens[i].second, version)) {
                release(s);
                done.push_back(finish(s));
            } else {
                keep.push_back(static_cast<int64_t>(i));
            }
        }
        if (keep.size() < active.size()) keep_rows(keep);
        if (gen)
            decode_seconds +=
                std::chrono::duration<double>(std::chrono::steady_clock::now() - decode_t0).count();
        return done;
    }

    // Whether admit() would take a request or run a prefill part now (finished husks hold no slot).
    bool admission_due() const {
        if (!joining.empty()) return true;
        if (waiting.empty()) return false;
        const size_t husks = static_cast<size_t>(
            std::count_if(active.begin(), active.end(), [](const Seq& s) { return s.finished; }));
        return admissible(held() - husks) > 0;
    }

    // Queues a decode step of active[rows] on `in` (host ids, or the last queued step's draws on the
    // device); `ahead`: draws of these rows already queued and not yet collected.
    void queue(const std::vector<int64_t>& rows, const at::Tensor& in, int ahead, int64_t version) {
        std::vector<int> slots;
        std::vector<double> u;
        for (int64_t r : rows) {
            const Seq& s = active[r];
            slots.push_back(s.slot);
            u.push_back(uniform_draw(s.req.seed, s.traj.rng_draws + ahead));
        }
        decode_dense_bytes += static_cast<double>(gen->dense_bytes_per_step(static_cast<int>(slots.size())));
        ++decode_steps;
        gen->queue_step(slots, in, u, params.temperature);
        queued_versions.push_back(version);
    }

    // Reads the oldest queued step's draws into active[0..n), its rows: a row that finished earlier
    // is skipped, one that finishes now leaves (done) and stays as a husk until the caller drops it.
    void collect(std::vector<GenResult>& done) {
        const model::DrawnStep d = gen->collect_step();
        const int64_t version = queued_versions.front();
        queued_versions.pop_front();
        at::Tensor routing;
        if (record_routing) routing = d.routing.unsqueeze(1).contiguous();  // [n, 1, M, K]
        for (size_t i = 0; i < d.tokens.size(); ++i) {
            Seq& s = active[i];
            if (s.finished) continue;
            if (record_routing) append_routing(s, routing, static_cast<int64_t>(i), 0);
            ++s.traj.rng_draws;
            if (take(s, static_cast<int>(d.tokens[i]), d.logprobs[i], version)) {
                release(s);
                done.push_back(finish(s));
                s.finished = true;
            }
        }
    }

    void drop_finished() {
        std::vector<int64_t> live;
        for (size_t i = 0; i < active.size(); ++i)
            if (!active[i].finished) live.push_back(static_cast<int64_t>(i));
        if (live.size() < active.size()) keep_rows(live);
    }

    // The CUDA engine in one process, with untruncated sampling drawn on the device. While no
    // request is due to join, step t+1 is queued on step t's draws as they lie on the device before
    // the host reads step t's, so the GPU goes from one step into the next while the host keeps its
    // books (a step of 128 rows left the GPU idle ~0.1 ms of ~2.1 waiting for the host). A sequence
    // that stops with step t's draw has step t+1 computed for it and dropped; one that reaches its
    // length limit is left out of step t+1. The draws are the same as step()'s: each comes from the
    // sequence's seed and its draw count.
    std::vector<GenResult> step_queued(int64_t version) {
        c10::NoGradGuard no_grad;
        std::vector<GenResult> done;
        auto t0 = std::chrono::steady_clock::now();
        auto timed = [&] {
            const auto t = std::chrono::steady_clock::now();
            decode_seconds += std::chrono::duration<double>(t - t0).count();
            t0 = t;
        };
        if (gen->queued_steps() > 0 && !admission_due()) {
            std::vector<int64_t> rows;
            std::vector<int> slots;
            for (size_t i = 0; i < active.size(); ++i) {
                const Seq& s = active[i];
                if (s.finished || static_cast<int>(s.traj.tokens.size()) + 1 >= s.req.max_new_tokens)
                    continue;
                rows.push_back(static_cast<int64_t>(i));
                slots.push_back(s.slot);
            }
            const bool next = !rows.empty() && gen->step_fits(slots);
            if (next) {
                at::Tensor in = gen->queued_tokens();
                if (rows.size() < active.size())
                    in = in.index_select(0, at::tensor(rows, at::kLong).to(in.device()));
                queue(rows, in, /*ahead=*/1, version);
            }
            collect(done);
            if (next) {
                keep_rows(rows);
            } else {
                drop_finished();
            }
            timed();
            return done;
        }
        if (gen->queued_steps() > 0) {
            collect(done);
            drop_finished();
            timed();
        }
        admit(version, done, /*prefill_pass=*/false);
        if (!active.empty()) {
            t0 = std::chrono::steady_clock::now();
            std::vector<int64_t> rows(active.size()), in;
            std::iota(rows.begin(), rows.end(), 0);
            for (const Seq& s : active) in.push_back(s.next_input);
            queue(rows, at::tensor(in, at::kLong), /*ahead=*/0, version);
            timed();
        }
        return done;
    }

    // Before the model's weights change in place: the queued steps finish reading the old ones.
    void settle() {
        if (gen && gen->queued_steps() > 0) gen->wait_queued();
    }

    // Removes every unfinished sequence and returns its partial trajectory (preemption).
    std::vector<GenResult> drain() {
        std::vector<GenResult> out;
        // A queued step's draws are dropped: a resumed sequence draws them again, the same ones.
        if (gen && gen->queued_steps() > 0) gen->drop_queued();
        queued_versions.clear();
        for (auto& s : active) {
            if (s.finished) continue;  // returned already
            release(s);
            s.traj.routing.clear();  // a resumed sequence recomputes it in its prefill
            out.push_back({s.req.id, std::move(s.traj)});
        }
        for (JoiningGroup& j : joining)
            for (Seq& s : j.seqs) {
                release(s);
                out.push_back({s.req.id, s.req.prefix});
            }
        joining.clear();
        for (auto& r : waiting) out.push_back({r.id, r.prefix});
        active.clear();
        waiting.clear();
        cache = model::KvCache();
        return out;
    }
};

// ---- over processes ----
namespace {

nlohmann::json request_to_json(const GenRequest& r) {
    return {{"id", r.id},
            {"prompt", r.prompt},
            {"prefix", to_json(r.prefix)},
            {"seed", r.seed},
            {"max_new_tokens", r.max_new_tokens}};
}

GenRequest request_from_json(const nlohmann::json& j) {
    GenRequest r;
    r.id = j.at("id").get<uint64_t>();
    r.prompt = j.at("prompt").get<std::vector<int>>();
    r.prefix = trajectory_from_json(j.at("prefix").get<std::string>());
    r.seed = j.at("seed").get<uint64_t>();
    r.max_new_tokens = j.at("max_new_tokens").get<int>();
    return r;
}

// What a rank hands rank 0 after a call: the sequences that left it, and its counts so far.
std::string results_to_bytes(const std::vector<GenResult>& results, const RankCounts& c) {
    nlohmann::json out = nlohmann::json::array();
    for (const GenResult& r : results) out.push_back({{"id", r.id}, {"trajectory", to_json(r.trajectory)}});
    return nlohmann::json{{"results", out},
                          {"tokens", c.tokens},
                          {"prompt_tokens", c.prompt_tokens},
                          {"prompt_tokens_shared", c.prompt_tokens_shared}}
        .dump();
}

}  // namespace

// Rank 0's view of an engine over processes.
struct RolloutEngine::Spread {
    std::unique_ptr<detail::RankGroup> group;
    int rank = 0, world = 1;
    std::deque<GenRequest> pending;  // rank 0: added, not yet handed to a rank
    std::vector<int> held;           // rank 0: sequences each rank holds
    std::vector<RankCounts> counts;  // rank 0: what each rank sampled and prefilled
    std::string failure;             // why the engine cannot go on (a call over the ranks failed)

    // Runs a call over the ranks; any failure leaves the engine unusable.
    template <class Fn>
    auto guarded(Fn fn) {
        MOERL_CHECK(failure.empty(), "rollout engine over ", world, " processes: cannot go on after ",
                    failure);
        try {
            return fn();
        } catch (const std::exception& e) {
            failure = e.what();
            throw;
        }
    }

    // Rank 0: `mine` (the sequences that left rank 0, with its counts) and what every other rank
    // handed back.
    std::vector<GenResult> collect(std::vector<GenResult> mine, const RankCounts& my_counts) {
        std::vector<GenResult> all = std::move(mine);
        held[0] -= static_cast<int>(all.size());
        counts[0] = my_counts;
        const std::vector<std::string> parts = group->gather("");
        for (int q = 1; q < world; ++q) {
            const nlohmann::json j = nlohmann::json::parse(parts[q]);
            for (const auto& r : j.at("results")) {
                all.push_back({r.at("id").get<uint64_t>(),
                               trajectory_from_json(r.at("trajectory").get<std::string>())});
                --held[q];
            }
            counts[q] = {j.at("tokens").get<int64_t>(), j.at("prompt_tokens").get<int64_t>(),
                         j.at("prompt_tokens_shared").get<int64_t>()};
        }
        return all;
    }
};

RolloutEngineOptions rollout_engine_options(const RunConfig& c, const RoleProcesses* processes) {
    RolloutEngineOptions o;
    o.max_batch = c.rollout_max_batch;
    o.record_routing = c.record_routing;
    o.max_seq_len = c.rollout_max_seq_len;
    o.processes = processes;
    o.fp8_weights = c.rollout_dtype == "fp8";
    o.fp8_kv_cache = c.rollout_kv_cache_dtype == "fp8";
    o.prefill_chunk_tokens = c.rollout_prefill_chunk_tokens;
    return o;
}

RolloutEngine::RolloutEngine(const model::MoeModel& model, const SamplingParams& params,
                             const RolloutEngineOptions& options) {
    MOERL_CHECK(options.max_batch >= 1, "rollout max_batch must be >= 1, got ", options.max_batch);
    MOERL_CHECK(params.temperature > 0, "sampling temperature must be > 0, got ", params.temperature);
    MOERL_CHECK(options.max_seq_len >= 2, "rollout max_seq_len must be >= 2, got ", options.max_seq_len);
    MOERL_CHECK(options.prefill_chunk_tokens >= 0, "rollout prefill_chunk_tokens must be >= 0, got ",
                options.prefill_chunk_tokens);
    const RoleProcesses* processes = options.processes;
    const bool spread = processes != nullptr && processes->world_size > 1;
    impl_ = std::make_unique<Impl>(model, params, options, spread ? processes : nullptr);
    if (!spread) return;
    MOERL_CHECK(model.options().ep != nullptr && model.config().num_moe_layers() > 0, "rollout engine over ",
                processes->world_size,
                " processes: the model must shard its experts over them (an EP buffer)");
    spread_ = std::make_unique<Spread>();
    spread_->rank = processes->rank;
    spread_->world = processes->world_size;
    spread_->held.assign(spread_->world, 0);
    spread_->counts.assign(spread_->world, RankCounts{});
    spread_->group = detail::make_process_group(*processes, "rollout");
}

RolloutEngine::~RolloutEngine() {
    if (spread_ && !spread_->failure.empty()) impl_->abandoned = true;
    if (!spread_ || spread_->rank != 0 || !spread_->failure.empty()) return;
    try {
        spread_->group->send_call(nlohmann::json{{"call", "stop"}}.dump());
    } catch (...) {
    }
}

void RolloutEngine::add(GenRequest request) {
    MOERL_CHECK(!request.prompt.empty(), "rollout request ", request.id, " has an empty prompt");
    const int64_t longest = static_cast<int64_t>(request.prompt.size()) +
                            std::max<int64_t>(request.max_new_tokens, request.prefix.tokens.size());
    MOERL_CHECK(!impl_->gen || longest <= impl_->max_seq_len, "rollout request ", request.id, " needs ",
                longest, " tokens (prompt + max_new_tokens), above the CUDA engine's max_seq_len ",
                impl_->max_seq_len);
    if (spread_) {
        spread_->pending.push_back(std::move(request));
    } else {
        impl_->waiting.push_back(std::move(request));
    }
}

std::vector<GenResult> RolloutEngine::step(int64_t policy_version) {
    if (!spread_) return impl_->step(policy_version);
    Spread& sp = *spread_;
    MOERL_CHECK(sp.rank == 0, "rollout engine rank ", sp.rank, ": only rank 0 steps; the others follow()");
    // New requests go to the ranks holding the fewest sequences (rank 0 keeps its own as they are),
    // a group's samples to one rank, where they share their prompt.
    std::vector<nlohmann::json> admit(sp.world, nlohmann::json::array());
    std::vector<GenRequest> mine;
    bool prefill = false;
    while (!sp.pending.empty()) {
        int q = 0;
        for (int r = 1; r < sp.world; ++r)
            if (sp.held[r] < sp.held[q]) q = r;
        const size_t room = static_cast<size_t>(std::max(0, impl_->max_batch - sp.held[q]));
        const size_t take =
            !impl_->shares_prompts()
                ? std::min<size_t>(room, 1)
                : std::min(detail::whole_groups(sp.pending, room, impl_->max_batch, sp.held[q] == 0, true),
                           detail::same_context_run(sp.pending, 0));
        if (take == 0) break;
        for (size_t i = 0; i < take; ++i) {
            if (q == 0) {
                mine.push_back(std::move(sp.pending.front()));
            } else {
                admit[q].push_back(request_to_json(sp.pending.front()));
            }
            sp.pending.pop_front();
        }
        sp.held[q] += static_cast<int>(take);
        prefill = true;
    }
    // Every rank decodes (or joins the decode empty) while any rank holds a sequence.
    if (std::all_of(sp.held.begin(), sp.held.end(), [](int h) { return h == 0; })) return {};
    return sp.guarded([&] {
        sp.group->send_call(nlohmann::json{
            {"call", "step"},
            {"version", policy_version},
            {"prefill", prefill},
            {"admit", admit}}.dump());
        for (GenRequest& r : mine) impl_->waiting.push_back(std::move(r));
        std::vector<GenResult> done = impl_->step(policy_version, prefill, /*decode_pass=*/true);
        return sp.collect(std::move(done), impl_->counts());
    });
}

std::vector<GenResult> RolloutEngine::run_to_completion(int64_t policy_version) {
    std::vector<GenResult> all;
    while (!idle()) {
        auto d = step(policy_version);
        for (auto& r : d) all.push_back(std::move(r));
    }
    return all;
}

std::vector<GenResult> RolloutEngine::drain() {
    std::vector<GenResult> out;
    if (spread_) {
        Spread& sp = *spread_;
        if (sp.failure.empty()) {
            out = sp.guarded([&] {
                sp.group->send_call(nlohmann::json{{"call", "drain"}}.dump());
                std::vector<GenResult> drained = impl_->drain();
                return sp.collect(std::move(drained), impl_->counts());
            });
        } else {
            impl_->drain();
            sp.held.assign(sp.world, 0);
        }
        for (auto& r : sp.pending) out.push_back({r.id, r.prefix});
        sp.pending.clear();
        return out;
    }
    return impl_->drain();
}

int64_t RolloutEngine::refresh_weights(const std::string& source, const std::function<int64_t()>& load_here) {
    impl_->settle();
    if (!spread_) {
        const int64_t bytes = load_here ? load_here() : 0;
        if (impl_->gen) impl_->gen->refresh_weights();
        return bytes;
    }
    Spread& sp = *spread_;
    int64_t bytes = 0;
    std::exception_ptr failed_here;
    const std::vector<std::string> replies = sp.guarded([&] {
        sp.group->send_call(nlohmann::json{{"call", "refresh"}, {"source", source}}.dump());
        // Rank 0 loads while the others do; every rank answers the gather, whatever happened here.
        try {
            if (load_here) bytes = load_here();
            if (impl_->gen) impl_->gen->refresh_weights();
        } catch (...) {
            failed_here = std::current_exception();
        }
        return sp.group->gather("");
    });
    if (failed_here) std::rethrow_exception(failed_here);
    for (int q = 1; q < sp.world; ++q) {
        const nlohmann::json reply = nlohmann::json::parse(replies[q]);
        MOERL_CHECK(!reply.contains("error"), "rollout rank ", q, " of ", sp.world, " could not load ",
                    source, ": ", reply.value("error", ""));
        bytes += reply.at("bytes").get<int64_t>();
    }
    return bytes;
}

bool RolloutEngine::carry_out(const std::string& bytes,
                              const std::function<int64_t(const std::string&)>& load) {
    Spread& sp = *spread_;
    const nlohmann::json c = nlohmann::json::parse(bytes);
    const std::string what = c.at("call").get<std::string>();
    if (what == "stop") return false;
    if (what == "step") {
        for (const auto& r : c.at("admit").at(sp.rank)) impl_->waiting.push_back(request_from_json(r));
        const std::vector<GenResult> done =
            impl_->step(c.at("version").get<int64_t>(), c.at("prefill").get<bool>(), /*decode_pass=*/true);
        sp.group->gather(results_to_bytes(done, impl_->counts()));
    } else if (what == "drain") {
        const std::vector<GenResult> drained = impl_->drain();
        sp.group->gather(results_to_bytes(drained, impl_->counts()));
    } else if (what == "refresh") {
        nlohmann::json reply;
        try {
            impl_->settle();
            reply["bytes"] = load(c.at("source").get<std::string>());
            if (impl_->gen) impl_->gen->refresh_weights();
        } catch (const std::exception& e) {
            reply = {{"error", e.what()}};
        }
        sp.group->gather(reply.dump());
    } else {
        MOERL_FAIL("rollout rank ", sp.rank, ": rank 0 made an unknown call '", what, "'");
    }
    return true;
}

void RolloutEngine::follow(const std::function<int64_t(const std::string&)>& load) {
    MOERL_CHECK(spread_ && spread_->rank > 0,
                "follow: only ranks 1.. of a rollout engine over processes follow rank 0");
    while (carry_out(spread_->group->receive_call(), load)) {
    }
}

bool RolloutEngine::healthy() const { return !spread_ || spread_->failure.empty(); }
int RolloutEngine::capacity() const { return impl_->max_batch * (spread_ ? spread_->world : 1); }
bool RolloutEngine::uses_generator() const { return impl_->gen != nullptr; }

size_t RolloutEngine::num_active() const {
    if (!spread_) return impl_->held();
    size_t n = 0;
    for (int h : spread_->held) n += static_cast<size_t>(h);
    return n;
}
size_t RolloutEngine::num_waiting() const {
    return spread_ ? spread_->pending.size() : impl_->waiting.size();
}
int64_t RolloutEngine::release_memory() {
    if (!impl_->gen || !idle()) return 0;
    return impl_->gen->release_memory();
}
int64_t RolloutEngine::kept_memory_bytes() const { return impl_->gen ? impl_->gen->kept_memory_bytes() : 0; }

namespace {
template <class Field>
int64_t engine_total(const RankCounts& mine, const std::vector<RankCounts>* ranks, Field field) {
    if (ranks == nullptr) return mine.*field;
    int64_t n = 0;
    for (const RankCounts& c : *ranks) n += c.*field;
    return n;
}
}  // namespace

int64_t RolloutEngine::prompt_tokens() const {
    return engine_total(impl_->counts(), spread_ ? &spread_->counts : nullptr, &RankCounts::prompt_tokens);
}
int64_t RolloutEngine::prompt_tokens_shared() const {
    return engine_total(impl_->counts(), spread_ ? &spread_->counts : nullptr,
                        &RankCounts::prompt_tokens_shared);
}
DecodeTraffic RolloutEngine::decode_traffic() const {
    const Impl& m = *impl_;
    if (!m.gen || m.traffic.steps == m.decode_steps) return m.traffic;
    const model::GeneratorStats st = m.gen->stats();  // the expert reads are counted on the device
    m.traffic.seconds = m.decode_seconds;
    m.traffic.steps = m.decode_steps;
    m.traffic.bytes =
        m.decode_dense_bytes +
        static_cast<double>(st.expert_weight_reads) * static_cast<double>(m.gen->expert_bytes()) +
        static_cast<double>(st.kv_tokens_read) * static_cast<double>(m.gen->kv_bytes_per_token());
    return m.traffic;
}

int64_t RolloutEngine::tokens_generated() const {
    return engine_total(impl_->counts(), spread_ ? &spread_->counts : nullptr, &RankCounts::tokens);
}

}  // namespace moerl::rl
