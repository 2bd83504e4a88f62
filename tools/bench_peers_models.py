"""The models tools/bench_peers.py measures: their shapes, how torch builds them, how
torch.distributed.pipelining cuts them in two, and their FLOPs per step.

  small       the benchmark GPT: GPT2LMHeadModel, 6 blocks, width 256, 8 heads, vocabulary
              2,000, untied head; sequence 64, batch 8, M = 8
  gpt2-124m   GPT-2 small, the published shape: 12 blocks, width 768, 12 heads, vocabulary
              50,257, head tied to the embedding (124M parameters); sequence 128, batch 8, M = 4
  llama-246m  LlamaForCausalLM: 16 layers, width 1024, 16 heads over 4 key/value heads,
              feed-forward 2816, vocabulary 32,000, untied head (246M); sequence 128, batch 8,
              M = 4

Every model is seeded, every dropout 0, and each parameter nudged by 1e-3 x randn (as in the
torch fixtures: equal initial weights, such as fresh norm weights, would otherwise be merged
by the exporter into one weight that pipec trains as one).
"""
import os
import sys

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

SIZES = {
    "small": dict(arch="gpt2", layers=6, width=256, heads=8, kv_heads=8, ff=1024, vocab=2000,
                  seq=64, batch=8, micro=8, tie=False,
                  label="GPT2LMHeadModel, 6 blocks, width 256, 8 heads, vocabulary 2,000, "
                        "untied head"),
    "gpt2-124m": dict(arch="gpt2", layers=12, width=768, heads=12, kv_heads=12, ff=3072,
                      vocab=50257, seq=128, batch=8, micro=4, tie=True,
                      label="GPT-2 small (GPT2LMHeadModel, the published shape: 12 blocks, "
                            "width 768, 12 heads, vocabulary 50,257, tied head; 124M "
                            "parameters)"),
    "llama-246m": dict(arch="llama", layers=16, width=1024, heads=16, kv_heads=4, ff=2816,
                       vocab=32000, seq=128, batch=8, micro=4, tie=False,
                       label="LlamaForCausalLM, 16 layers, width 1024, 16 heads over 4 "
                             "key/value heads, feed-forward 2816, vocabulary 32,000, untied "
                             "head (246M parameters)"),
}


def build(size, seed):
    """The model of \\p size, seeded and nudged, in train() mode."""
    import torch
    sys.path.insert(0, FIXTURES)
    import _torch_fixture_common as C
    s = SIZES[size]
    torch.manual_seed(seed)
    if s["arch"] == "gpt2":
        model = C.build_gpt2(tie=s["tie"], vocab=s["vocab"], n_embd=s["width"],
                             n_layer=s["layers"], n_head=s["heads"], n_positions=s["seq"])
        tied = model.lm_head.weight is model.transformer.wte.weight
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["width"],
                          intermediate_size=s["ff"], num_hidden_layers=s["layers"],
                          num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                          max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                          attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False,
                          use_cache=False)
        model = LlamaForCausalLM(cfg)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied != s["tie"]:
        raise ValueError("%s: the LM head is %s the embedding, expected %s" %
                         (size, "tied to" if tied else "untied from",
                          "tied" if s["tie"] else "untied"))
    C.nudge(model)
    model.train()
    return model


def flops(size):
    """(training, inference) FLOPs of one step of the global batch, counted from the shape:
    2 x tokens x (the matrix products' weights) + 4 x tokens x seq x width x layers
    (attention scores and their product with V, the causal half not subtracted); training
    3 x forward."""
    s = SIZES[size]
    d, tokens = s["width"], s["batch"] * s["seq"]
    kv = d * s["kv_heads"] // s["heads"]
    if s["arch"] == "gpt2":
        per_layer = 4 * d * d + 2 * d * s["ff"]
    else:
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * s["ff"]
    forward = 2 * tokens * (s["layers"] * per_layer + d * s["vocab"]) + \
        4 * tokens * s["seq"] * d * s["layers"]
    return 3 * forward, forward


def pipeline_stages(model, size):
    """The model cut after layer LAYERS / 2 into two torch modules: the embeddings and the first
    half of the layers; the second half, the final norm and the head."""
    import torch
    s = SIZES[size]
    half = s["layers"] // 2

    def run_blocks(blocks, x, **kw):
        """x through each block in turn (a block may return a tuple: its hidden state first)."""
        for block in blocks:
            out = block(x, **kw)
            x = out[0] if isinstance(out, tuple) else out
        return x

    if s["arch"] == "gpt2":
        t = model.transformer

        class First(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
                self.h = torch.nn.ModuleList(t.h[:half])

            def forward(self, input_ids):
                pos = torch.arange(input_ids.shape[1], device=input_ids.device)
                return run_blocks(self.h, self.drop(self.wte(input_ids) + self.wpe(pos)))

        class Last(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.h = torch.nn.ModuleList(t.h[half:])
                self.ln_f, self.lm_head = t.ln_f, model.lm_head
                if s["tie"]:  # each stage keeps its own copy of the tied table
                    self.lm_head = torch.nn.Linear(s["width"], s["vocab"], bias=False)
                    self.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())

            def forward(self, x):
                return self.lm_head(self.ln_f(run_blocks(self.h, x)))

        return First(), Last()

    m = model.model

    def run_layers(layers, x):
        """x through Llama's layers, with the rotary embeddings of its positions."""
        ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
        return run_blocks(layers, x, position_embeddings=m.rotary_emb(x, ids),
                          attention_mask=None)

    class LlamaFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = m.embed_tokens
            self.layers = torch.nn.ModuleList(m.layers[:half])

        def forward(self, input_ids):
            return run_layers(self.layers, self.embed_tokens(input_ids))

    class LlamaLast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(m.layers[half:])
            self.norm, self.lm_head = m.norm, model.lm_head

        def forward(self, x):
            return self.lm_head(self.norm(run_layers(self.layers, x)))

    return LlamaFirst(), LlamaLast()
