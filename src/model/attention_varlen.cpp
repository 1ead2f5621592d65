// Variable-length causal attention through LibTorch's FlashAttention kernel (cumulative sequence
// lengths, no mask): packed training rows cost the attention of their sequences, not of the row.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "moerl/core/error.hpp"
#include "moerl/model/layers.hpp"

// The varlen entry point with this positional signature from LibTorch 2.4 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define MOERL_HAVE_FLASH_VARLEN 1
#endif

namespace moerl::model {
namespace {

enum class KvHeads { kUnavailable, kNative, kRepeated };

#ifdef MOERL_HAVE_FLASH_VARLEN
// [T, Hkv, D] -> [T, Hq, D], each key/value head repeated for its query group.
at::Tensor repeat_heads(const at::Tensor& x, int64_t q_heads) {
    const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2);
    return x.unsqueeze(2).expand({T, Hkv, q_heads / Hkv, D}).reshape({T, q_heads, D});
}

at::Tensor flash_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu,
                        int64_t max_len, KvHeads mode) {
    const int64_t Hq = q.size(1);
    at::Tensor kk = mode == KvHeads::kRepeated ? repeat_heads(k, Hq) : k;
    at::Tensor vv = mode == KvHeads::kRepeated ? repeat_heads(v, Hq) : v;
    return std::get<0>(at::_flash_attention_forward(q, kk, vv, cu, cu, max_len, max_len, 0.0,
                                                    /*is_causal=*/true, /*return_debug_mask=*/false,
                                                    1.0 / std::sqrt(static_cast<double>(q.size(2)))));
}

// Two sequences (lengths 3 and 5) through the kernel against the dense reference; with gradients.
bool probe(const at::TensorOptions& opts, int64_t Hq, int64_t Hkv, int64_t D, KvHeads mode) {
    try {
        c10::AutoGradMode grad(true);
        const int64_t T = 8;
        auto values = [&](int64_t heads, double phase) {
            at::Tensor t =
                at::linspace(0, 1, T * heads * D, opts.dtype(at::kFloat)).mul(37.0).add(phase).sin();
            return t.view({T, heads, D}).to(opts.dtype().toScalarType()).requires_grad_(true);
        };
        at::Tensor q = values(Hq, 0.1), k = values(Hkv, 0.7), v = values(Hkv, 1.3);
        at::Tensor cu = at::tensor({0, 3, 8}, opts.dtype(at::kInt));
        at::Tensor out = flash_varlen(q, k, v, cu, 5, mode);
        out.to(at::kFloat).sum().backward();
        if (!q.grad().defined() || !k.grad().defined() || !v.grad().defined()) return false;
        // Dense reference per sequence.
        c10::NoGradGuard no_grad;
        double worst = 0;
        const int64_t bounds[3] = {0, 3, 8};
        for (int s = 0; s < 2; ++s) {
            const int64_t lo = bounds[s], n = bounds[s + 1] - lo;
            at::Tensor qs = q.narrow(0, lo, n).to(at::kFloat).permute({1, 0, 2}).unsqueeze(0);
            at::Tensor ks = k.narrow(0, lo, n).to(at::kFloat).permute({1, 0, 2}).unsqueeze(0);
            at::Tensor vs = v.narrow(0, lo, n).to(at::kFloat).permute({1, 0, 2}).unsqueeze(0);
            at::Tensor allowed = at::ones({n, n}, opts.dtype(at::kBool)).tril().unsqueeze(0);
            at::Tensor ref = attention(qs, ks, vs, allowed).view({n, Hq, D});
            worst = std::max(worst, (ref - out.narrow(0, lo, n).to(at::kFloat)).abs().max().item<double>());
        }
        return worst < 3e-2;
    } catch (const c10::Error&) {
        return false;
    }
}
#endif

KvHeads kv_heads_mode(const at::TensorOptions& opts, int64_t Hq, int64_t Hkv, int64_t D) {
#ifdef MOERL_HAVE_FLASH_VARLEN
    const at::ScalarType dtype = opts.dtype().toScalarType();
    if (opts.device().type() != at::kCUDA || (dtype != at::kBFloat16 && dtype != at::kHalf))
        return KvHeads::kUnavailable;
    if (D % 8 != 0 || D > 256 || Hkv <= 0 || Hq % Hkv != 0) return KvHeads::kUnavailable;
    static std::mutex mu;
    static std::map<std::tuple<int, int, int64_t, int64_t, int64_t>, KvHeads> known;
    std::lock_guard<std::mutex> lock(mu);
    const auto key =
        std::make_tuple(static_cast<int>(opts.device().index()), static_cast<int>(dtype), D, Hq, Hkv);
    auto it = known.find(key);
    if (it != known.end()) return it->second;
    KvHeads mode = KvHeads::kUnavailable;
    if (probe(opts, Hq, Hkv, D, KvHeads::kNative))
        mode = KvHeads::kNative;
    else if (probe(opts, Hq, Hkv, D, KvHeads::kRepeated))
        mode = KvHeads::kRepeated;
    known[key] = mode;
    return mode;
#else
    (void)opts, (void)Hq, (void)Hkv, (void)D;
    return KvHeads::kUnavailable;
#endif
}

}  // namespace

bool varlen_attention_available(const at::TensorOptions& options, int64_t q_heads, int64_t kv_heads,
                                int64_t head_dim) {
    return kv_heads_mode(options, q_heads, kv_heads, head_dim) != KvHeads::kUnavailable;
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const VarlenLayout& layout) {
    MOERL_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                "varlen_attention: q, k, v must be [B, S, H, D]");
    const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(2);
    const KvHeads mode = kv_heads_mode(q.options(), Hq, Hkv, D);
    MOERL_CHECK(mode != KvHeads::kUnavailable, "varlen_attention: no varlen kernel for ", q.device(), " ",
                q.scalar_type(), " with ", Hq, "/", Hkv, " heads of ", D);
#ifdef MOERL_HAVE_FLASH_VARLEN
    at::Tensor out =
        flash_varlen(q.reshape({B * S, Hq, D}).contiguous(), k.reshape({B * S, Hkv, D}).contiguous(),
                     v.reshape({B * S, Hkv, D}).contiguous(), layout.cu_seqlens, layout.max_len, mode);
    return out.view({B, S, Hq * D});
#else
    (void)layout, (void)B, (void)S;
    return {};
#endif
}

}  // namespace moerl::model
