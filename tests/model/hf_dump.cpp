// Writes a random fp32 checkpoint for a config.json and moerl's outputs on fixed inputs, for
// hf_parity.py to compare with Hugging Face transformers. Usage: model_hf_dump CONFIG OUT_DIR
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <exception>

#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"

using namespace moerl::model;

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s CONFIG.json OUT_DIR\n", argv[0]);
        return 2;
    }
    try {
        MoeModel m(ModelConfig::load(argv[1]), {});
        m.init_random(5);
        m.save_pretrained(argv[2], 0, "float32");
        const ModelConfig& c = m.config();
        at::manual_seed(0);
        const int64_t B = 3, S = 12;
        at::Tensor ids = at::randint(1, c.vocab_size, {B, S}, at::kLong);
        at::Tensor mask = at::ones({B, S}, at::kLong);
        mask[1].narrow(0, 0, 4).zero_();  // left padding
        mask[2].narrow(0, 0, 9).zero_();
        c10::NoGradGuard no_grad;
        ForwardOptions fo;
        fo.record_routing = true;
        ForwardOutput out = m.forward(ids, mask, fo);
        KvCache cache = m.new_cache(B, S);
        m.prefill(cache, ids.narrow(1, 0, S - 1), mask.narrow(1, 0, S - 1));
        at::Tensor decoded = m.decode(cache, ids.select(1, S - 1)).logits;
        std::vector<std::pair<const char*, at::Tensor>> outs = {
            {"ids", ids},
            {"mask", mask},
            {"logits", out.logits.contiguous()},
            {"aux", out.aux_loss.reshape({1})},
            {"routing", out.routing.to(at::kLong).contiguous()},
            {"decode_logits", decoded.contiguous()},
            {"token_logprobs", out.token_logprobs.contiguous()}};
        std::vector<TensorBytes> tensors;
        for (const auto& [name, t] : outs) {
            tensors.push_back({name, t.scalar_type() == at::kLong ? StDType::kI64 : StDType::kF32,
                               t.sizes().vec(), t.data_ptr(), static_cast<uint64_t>(t.nbytes())});
        }
        write_safetensors(std::string(argv[2]) + "/moerl_outputs.safetensors", tensors);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "model_hf_dump: %s\n", e.what());
        return 1;
    }
    return 0;
}
