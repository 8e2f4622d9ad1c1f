"""The core contract on stock models: 32 transformers families and torch's own
recurrent, convolutional, attention and random-activation layers, with dropout on,
in training mode.

Each case checkpoints the model's layers with ``apply_remat`` under one keep set
(nothing, the attention module, the feed-forward module, every Linear) and one
checkpoint option (the defaults, ``early_stop=False``, ``rebuild="always"``,
``determinism_check="bitwise"``), and compares one training step with the same step
without remat:

* the loss and every gradient are equal bit for bit;
* each checkpointed layer replayed once in backward;
* the buffers (BatchNorm's running statistics and counter) and the CPU generator
  end where they end without remat;
* with the default options and a full checkpoint (and, in the transformers models,
  with the attention or the feed-forward module kept), the forward leaves fewer
  bytes allocated than without remat: the profiler's count of what the forward
  allocated and did not free, torch's own numbers, not ours.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from helpers import recorded_replays
from torch import nn

from torch_remat.integrations import RematConfig, apply_remat

transformers = pytest.importorskip("transformers", reason="needs the 'transformers' extra")

VOCAB = 64
_D = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, max_position_embeddings=64)
_GQA = dict(_D, num_key_value_heads=2, attention_dropout=0.1)


def _families() -> dict:
    T = transformers
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)),
        "llama": (T.LlamaForCausalLM, T.LlamaConfig, _GQA),
        "mistral": (T.MistralForCausalLM, T.MistralConfig, _GQA),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, _GQA),
        "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(_GQA, head_dim=8)),
        "gemma": (T.GemmaForCausalLM, T.GemmaConfig, dict(_GQA, head_dim=8)),
        "olmo": (T.OlmoForCausalLM, T.OlmoConfig, _GQA),
        "starcoder2": (T.Starcoder2ForCausalLM, T.Starcoder2Config, dict(
            _GQA, residual_dropout=0.1, embedding_dropout=0.1)),
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig, dict(
            _GQA, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
        "phi": (T.PhiForCausalLM, T.PhiConfig, dict(
            _D, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1)),
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config, dict(_GQA, resid_pdrop=0.1, pad_token_id=0)),
        "opt": (T.OPTForCausalLM, T.OPTConfig, dict(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
            dropout=0.1, attention_dropout=0.1)),
        "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig, dict(
            _D, hidden_dropout=0.1, attention_dropout=0.1, eos_token_id=0, bos_token_id=0)),
        "gptj": (T.GPTJForCausalLM, T.GPTJConfig, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)),
        "falcon": (T.FalconForCausalLM, T.FalconConfig, dict(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            hidden_dropout=0.1, attention_dropout=0.1, bos_token_id=0, eos_token_id=0)),
        "bloom": (T.BloomForCausalLM, T.BloomConfig, dict(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.1,
            attention_dropout=0.1, bos_token_id=0, eos_token_id=0)),
        "bert": (T.BertForMaskedLM, T.BertConfig, dict(
            _D, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
        "roberta": (T.RobertaForMaskedLM, T.RobertaConfig, dict(
            _D, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=1,
            bos_token_id=0, eos_token_id=2)),
        "t5": (T.T5ForConditionalGeneration, T.T5Config, dict(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        "bart": (T.BartForConditionalGeneration, T.BartConfig, dict(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=None)),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config, dict(_GQA, head_dim=8)),
        "qwen2_moe": (T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, dict(
            _GQA, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, output_router_logits=True)),
        "granite": (T.GraniteForCausalLM, T.GraniteConfig, _GQA),
        "cohere": (T.CohereForCausalLM, T.CohereConfig, _GQA),
        "stablelm": (T.StableLmForCausalLM, T.StableLmConfig, dict(_GQA, hidden_dropout=0.1)),
        "olmo2": (T.Olmo2ForCausalLM, T.Olmo2Config, _GQA),
        "mpt": (T.MptForCausalLM, T.MptConfig, dict(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)),
        "codegen": (T.CodeGenForCausalLM, T.CodeGenConfig, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)),
        "mbart": (T.MBartForConditionalGeneration, T.MBartConfig, dict(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, forced_eos_token_id=None)),
        "distilbert": (T.DistilBertForMaskedLM, T.DistilBertConfig, dict(
            vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
            max_position_embeddings=64, dropout=0.1, attention_dropout=0.1)),
        "electra": (T.ElectraForMaskedLM, T.ElectraConfig, dict(
            _D, embedding_size=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
        "deberta_v2": (T.DebertaV2ForMaskedLM, T.DebertaV2Config, dict(
            _D, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            relative_attention=True, pos_att_type=["p2c", "c2p"])),
    }


# the layer classes to checkpoint where ``_no_split_modules`` does not name them alone
LAYER_CLASSES = {"mbart": ("MBartEncoderLayer", "MBartDecoderLayer"),
                 "distilbert": ("TransformerBlock",), "electra": ("ElectraLayer",),
                 "deberta_v2": ("DebertaV2Layer",)}


FAMILIES = list(_families())


def _is_attention(module: nn.Module) -> bool:
    return "Attention" in type(module).__name__


_FEED_FORWARD = ("MLP", "Mlp", "SparseMoe", "Intermediate", "LayerFF")


def _is_feed_forward(module: nn.Module) -> bool:
    name = type(module).__name__
    # OPT and BART have no feed-forward module: their fc1 and fc2 are the layer's own
    return any(k in name for k in _FEED_FORWARD) or (
        isinstance(module, nn.Linear) and getattr(module, "_fc_of_layer", False))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


KEEP = {"nothing": None, "attention": _is_attention, "feed-forward": _is_feed_forward,
        "linears": _is_linear}
OPTIONS = {
    "defaults": {},
    "no-early-stop": {"early_stop": False},
    "rebuild-always": {"rebuild": "always"},
    "bitwise-check": {"determinism_check": "bitwise"},
}


@functools.cache
def _initial(family: str) -> nn.Module:
    model_cls, config_cls, kwargs = _families()[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Training runs without a key/value cache: apply_remat drops one from a
        # checkpointed layer's call, as transformers' own checkpointing does, and a
        # layer that fills a cache runs other kernels (the cache's concatenation
        # makes keys and values contiguous), which differ in the last bits.
        config = config_cls(**kwargs, use_cache=False)
    torch.manual_seed(0)
    model = model_cls(config)
    for layer in _layers(model, family):
        for name in ("fc1", "fc2"):
            if isinstance(getattr(layer, name, None), nn.Linear):
                getattr(layer, name)._fc_of_layer = True
    return model.train()


def _layers(model: nn.Module, family: str) -> list[nn.Module]:
    names = set(LAYER_CLASSES.get(family) or model._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names and "Embeddings" not in type(m).__name__]


def _batch(family: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _step(model: nn.Module, forward, seed: int = 7, measure: bool = True):
    """One training step: loss, gradients, buffers and the CPU generator after it, and
    the bytes the forward left allocated (None unless ``measure``: the profiler makes a
    step of these small models ten times slower)."""
    live = None
    if measure:  # kernels that cache on first use (oneDNN) allocate outside the count
        forward(copy.deepcopy(model))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if measure:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            loss = forward(model)
        live = sum(e.self_cpu_memory_usage for e in prof.events())
    else:
        loss = forward(model)
    loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers, torch.get_rng_state(), live


def _assert_same_step(plain, remat_step, replayed, layers, fewer_bytes=True):
    loss, grads, buffers, rng, live = remat_step
    assert torch.equal(loss, plain[0]), f"loss {loss} != {plain[0]}"
    assert grads.keys() == plain[1].keys()
    for name, g in grads.items():
        ref = plain[1][name]
        assert (g is None) == (ref is None), f"{name}: gradient None on one side only"
        if g is not None:
            assert torch.equal(g, ref), f"{name}: max abs diff {(g - ref).abs().max()}"
    for name, b in buffers.items():
        assert torch.equal(b, plain[2][name]), f"buffer {name} differs from the run without remat"
    assert torch.equal(rng, plain[3]), "the CPU generator ends elsewhere than without remat"
    assert sorted(replayed) == sorted(layers), f"replayed {replayed}, checkpointed {layers}"
    if fewer_bytes and live is not None:
        assert live < plain[4], f"the forward left {live} B allocated, {plain[4]} B without remat"


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("keep", list(KEEP))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_trains_bitwise_with_fewer_bytes(family, keep, option):
    batch = _batch(family)

    def forward(model):
        return model(**batch).loss

    measure = option == "defaults"  # bytes do not depend on the other options
    plain = _step(copy.deepcopy(_initial(family)), forward, measure=measure)
    model = copy.deepcopy(_initial(family))
    layer_types = tuple({type(m) for m in _layers(model, family)})
    names = apply_remat(model, check_fn=lambda m: isinstance(m, layer_types),
                        remat=RematConfig(save_modules=KEEP[keep], **OPTIONS[option]))
    assert len(names) >= 2
    with recorded_replays() as replayed:
        step = _step(model, forward, measure=measure)
    # Every Linear kept: apply_remat keeps each SAVE region's outputs (it cannot see
    # their consumers), where autograd alone may keep only a later op's save (OPT's
    # out_proj and fc2 outputs feed dropout and the residual, which save no input).
    _assert_same_step(plain, step, replayed, names, fewer_bytes=keep != "linears")


# ------------------------------------------------------------ torch's own modules


class _Stack(nn.Module):
    """Embedding, two layers made by ``make_layer``, then a head."""

    def __init__(self, make_layer) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(make_layer() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


class _RecurrentLayer(nn.Module):
    def __init__(self, cell: type) -> None:
        super().__init__()
        self.rnn = cell(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, h):
        out, _ = self.rnn(self.norm(h))
        return h + self.drop(self.proj(out.tanh()))


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout2d(0.1)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.Sequential(_ConvBlock(), _ConvBlock())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.layers(self.stem(x))
        return self.head(h.mean((2, 3))).logsumexp(-1).mean()


class _Encoder(nn.Module):
    """torch's TransformerEncoderLayer (its fused fast path is inference-only)."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True,
                                       norm_first=norm_first) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


class _TorchLayer(nn.Module):
    """One of torch's layers between a norm and a residual add."""

    def __init__(self, make: type) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.inner = make()

    def forward(self, h):
        out = self.inner(self.norm(h))
        return h + (out[0] if isinstance(out, tuple) else out)


def _two_layer_lstm() -> nn.Module:
    return nn.LSTM(16, 16, num_layers=2, dropout=0.3, batch_first=True)


def _bidirectional_gru() -> nn.Module:
    return nn.GRU(16, 8, bidirectional=True, batch_first=True)


class _SelfAttention(nn.MultiheadAttention):
    def __init__(self) -> None:
        super().__init__(16, 4, dropout=0.2, batch_first=True)

    def forward(self, x):  # noqa: D102 (self-attention, returning the weights too)
        return super().forward(x, x, x, need_weights=True)


class _DecoderLayer(nn.TransformerDecoderLayer):
    def __init__(self) -> None:
        super().__init__(16, 4, 32, dropout=0.1, batch_first=True)

    def forward(self, x):  # noqa: D102 (attending to itself as the memory)
        return super().forward(x, x)


class _NoisyActivation(nn.Sequential):
    """RReLU (random slopes, drawn into a noise tensor it saves) and AlphaDropout."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 16), nn.RReLU(), nn.AlphaDropout(0.2))


TORCH_MODELS = {
    "lstm": (lambda: _Stack(lambda: _RecurrentLayer(nn.LSTM)), _RecurrentLayer, "ids"),
    "gru": (lambda: _Stack(lambda: _RecurrentLayer(nn.GRU)), _RecurrentLayer, "ids"),
    "rnn": (lambda: _Stack(lambda: _RecurrentLayer(nn.RNN)), _RecurrentLayer, "ids"),
    "conv-batchnorm": (_ConvNet, _ConvBlock, "image"),
    "encoder-post-norm": (lambda: _Encoder(False), nn.TransformerEncoderLayer, "ids"),
    "encoder-pre-norm": (lambda: _Encoder(True), nn.TransformerEncoderLayer, "ids"),
    "lstm-2-layers-dropout": (lambda: _Stack(lambda: _TorchLayer(_two_layer_lstm)), _TorchLayer, "ids"),
    "gru-bidirectional": (lambda: _Stack(lambda: _TorchLayer(_bidirectional_gru)), _TorchLayer, "ids"),
    "multihead-attention": (lambda: _Stack(lambda: _TorchLayer(_SelfAttention)), _TorchLayer, "ids"),
    "decoder-layer": (lambda: _Stack(lambda: _TorchLayer(_DecoderLayer)), _TorchLayer, "ids"),
    "rrelu-alpha-dropout": (lambda: _Stack(lambda: _TorchLayer(_NoisyActivation)), _TorchLayer, "ids"),
}
# what each keep set keeps in torch's modules
TORCH_KEEP = {
    "nothing": None,
    "recurrent-or-attention": (nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention, nn.Conv2d),
    "linears": nn.Linear,
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("keep", list(TORCH_KEEP))
@pytest.mark.parametrize("name", list(TORCH_MODELS))
def test_a_torch_model_trains_bitwise_with_fewer_bytes(name, keep, option):
    build, layer_type, data = TORCH_MODELS[name]
    torch.manual_seed(0)
    initial = build().train()
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(0, VOCAB, (4, 12), generator=g) if data == "ids"
         else torch.randn(4, 3, 8, 8, generator=g))

    measure = option == "defaults"
    plain = _step(copy.deepcopy(initial), lambda m: m(x), measure=measure)
    model = copy.deepcopy(initial)
    names = apply_remat(model, check_fn=lambda m: isinstance(m, layer_type),
                        remat=RematConfig(save_modules=TORCH_KEEP[keep], **OPTIONS[option]))
    assert len(names) == 2
    with recorded_replays() as replayed:
        step = _step(model, lambda m: m(x), measure=measure)
    # With a SAVE region these layers are mostly kept, and the RNG state each
    # checkpoint keeps for its dropout (5 KB) outweighs what they drop.
    _assert_same_step(plain, step, replayed, names, fewer_bytes=keep == "nothing")
