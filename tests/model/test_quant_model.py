"""Quantized weights in whole models (`[engine] quantization`): the default Q4_1 GGUF kept in its blocks
(`auto`) against the same file dequantized (`none`): weights, memory, logits, greedy output; `int8` on an HF
folder; a GGUF of mixed tensor types; the mode's errors, on the CPU only; the config key and its flag."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from mixserve import LLM, ModelRunner, SamplingParams
from mixserve.config import ConfigError, add_engine_flags, load_config, overrides_from_args
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model import quantization
from mixserve.model.cpu import quant_linear as ql
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.errors import ModelLoadError
from mixserve.model.gguf_file import read_gguf
from mixserve.model.loader import default_model_path, load_model
from tests.tiny_model import make_tiny_llama

# threads=1: the engine pins no thread. With more, a step binds the calling thread's OpenMP pool, and where
# that pool predates the engine (any parallel region earlier in this process, as the kernel tests run) it
# pins a non-OpenMP thread in the worker's place and the worker onto the main thread's core: ~100x slower
OPTIONS = dict(num_blocks=128, block_size=4, dtype="float32", device="cpu", enable_prefix_caching=False,
               threads=1)
TEXTS = ["What is the capital of France?", "Write a haiku about the sea."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# auto vs none with float products: the same weights (the decoder equals gguf's dequantize exactly,
# test_quant_linear.py), the sums in another order (kernel lanes, tiles vs one GEMM); over 30 layers that
# measured <= 2.8e-6 of the largest |logit| on the default model, <= 9e-7 on the tiny models
SAME_WEIGHTS_TOL = 5e-5


@pytest.fixture(scope="module")
def default_llms() -> Iterator[dict[str, LLM]]:
    if ql.unavailable() is not None:
        pytest.skip(f"the quantized CPU kernels do not build here: {ql.unavailable()}")
    threads = torch.get_num_threads()  # the engine sets torch's pool size for the whole process
    llms = {mode: LLM(None, quantization=mode, **OPTIONS) for mode in ("auto", "none")}
    yield {**llms, "int8-inputs": LLM(None, quantization="auto", int8_activations=True, **OPTIONS)}
    torch.set_num_threads(threads)


def quant_weights(model) -> dict[int, QuantWeight]:
    return {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, QuantWeight)}


def linears(model) -> list[tuple[torch.nn.Module, str]]:
    """(owner, attribute) of the token table and every dense linear."""
    return [(model, "embed")] + [(o, a) for layer in model.layers for o, a in (
        (layer, "qkv"), (layer, "o_proj"), (layer.mlp, "gate_up"), (layer.mlp, "down"))]


def teacher_forced(runner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of the prompt's last position (one prefill) and after each of `tokens` (decode steps)."""
    table, seq, rows = list(range(32)), list(prompt), []
    with torch.no_grad():
        rows.append(runner.forward(ForwardBatch([ForwardSeq("q", seq, 0, table)]))[0].clone())
        for t in tokens:
            seq.append(t)
            rows.append(runner.forward(ForwardBatch([ForwardSeq("q", [t], len(seq) - 1, table)]))[0].clone())
    return torch.stack(rows)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst |got - want| of a row relative to that row's largest |want|."""
    return float(((got - want).abs().amax(1) / want.abs().amax(1)).max())


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_auto_keeps_the_files_blocks(default_llms) -> None:
    auto, none = (default_llms[m].engine.runner.model for m in ("auto", "none"))
    assert isinstance(auto.embed, QuantWeight) and auto.embed.formats == ("Q8_0",)
    assert auto.lm_head is auto.embed  # the tied head reads the same table
    for layer in auto.layers:
        for w in (layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down):
            assert isinstance(w, QuantWeight) and w.formats == ("Q4_1",)
    assert auto.layers[0].qkv.shape == tuple(none.layers[0].qkv.shape) == (960, 576)
    assert not quant_weights(none) and isinstance(none.embed, torch.nn.Parameter)


def test_auto_holds_no_float_copy_of_the_linears(default_llms) -> None:
    model = default_llms["auto"].engine.runner.model
    _, tensors = read_gguf(default_model_path())
    quantized = sum(t.data.nbytes for t in tensors.values() if t.ggml_type in ql.FORMATS)
    assert sum(w.nbytes for w in quant_weights(model).values()) == quantized  # each kept tensor once
    params = dict(model.named_parameters())
    assert all(name.split(".")[-1].endswith("norm") for name in params), sorted(params)
    cfg = model.config
    assert sum(p.numel() for p in params.values()) == cfg.hidden_size * (2 * cfg.num_layers + 1)
    teacher_forced(default_llms["auto"].engine.runner, chat(default_llms["auto"], TEXTS[0]), [])
    assert sum(t.numel() for t in ql._SCRATCH) <= ql._TILE_ELEMS  # prefill decodes tiles, never a whole head


def test_logits_equal_none_with_float_products(default_llms) -> None:
    runners = {m: llm.engine.runner for m, llm in default_llms.items()}
    prompt = chat(default_llms["none"], TEXTS[0])
    assert len(prompt) > ql.FEW_ROWS  # the prefill takes the tiles, the head and the decodes the block kernel
    tokens = [o.token_ids for o in default_llms["none"].generate([prompt], GREEDY, use_tqdm=False)][0][:6]
    want = teacher_forced(runners["none"], prompt, tokens)
    got = teacher_forced(runners["auto"], prompt, tokens)
    assert max_rel(got, want) < SAME_WEIGHTS_TOL, max_rel(got, want)


def test_bf16_dtype_takes_bf16_panels_and_stays_as_close_as_bf16(default_llms,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype bfloat16 (the opt-in for speed): a prefill's quantized linears multiply bf16 panels where the
    kernels have AVX512-BF16. Its logits measured 0.022-0.037 of the largest |logit| from float32 `none`,
    as far as `none` in bf16 is (0.026-0.039); a wrong panel would be garbage."""
    llm = LLM(None, quantization="auto", **{**OPTIONS, "dtype": "bfloat16"})
    calls: list[int] = []
    bf16_panels = ql._bf16_panels
    monkeypatch.setattr(ql, "_bf16_panels", lambda *args: calls.append(1) or bf16_panels(*args))
    prompt = chat(llm, TEXTS[0])
    assert len(prompt) >= ql.BF16_PANEL_ROWS
    tokens = [o.token_ids for o in default_llms["none"].generate([prompt], GREEDY, use_tqdm=False)][0][:6]
    got = teacher_forced(llm.engine.runner, prompt, tokens).float()
    assert len(calls) == (4 * llm.engine.runner.model.config.num_layers if ql.bf16_panels() else 0)
    assert max_rel(got, teacher_forced(default_llms["none"].engine.runner, prompt, tokens)) < 0.06


def test_logits_with_int8_inputs_stay_close(default_llms) -> None:
    # int8_activations: inputs rounded to int8 per 32 (step amax / 127) in every Q4_1 / Q8_0 product, the
    # prefill's (VNNI panels where built) and the decode steps' (block kernel): measured up to 4e-2 of the
    # largest |logit| over 6 decode steps (float products: 3e-6); enough to flip close top-2s
    model = default_llms["int8-inputs"].engine.runner.model
    assert all(w.int8_inputs for w in quant_weights(model).values())  # the file's Q4_1 and Q8_0, all marked
    runners = {m: llm.engine.runner for m, llm in default_llms.items()}
    prompt = chat(default_llms["none"], TEXTS[1])
    tokens = [o.token_ids for o in default_llms["none"].generate([prompt], GREEDY, use_tqdm=False)][0][:6]
    got, want = (teacher_forced(runners[m], prompt, tokens) for m in ("int8-inputs", "none"))
    assert 1e-4 < max_rel(got, want) < 0.1  # rounded (not the float path), and close


def test_greedy_generation_is_identical(default_llms) -> None:
    prompts = [chat(default_llms["none"], t) for t in TEXTS]
    out = {m: [o.token_ids for o in default_llms[m].generate(prompts, GREEDY, use_tqdm=False)]
           for m in ("auto", "none")}
    assert out["auto"] == out["none"] and all(len(t) == 16 for t in out["none"])
    assert "Paris" in default_llms["auto"].tokenizer.decode(out["auto"][0])


def test_int8_mode_on_an_hf_folder(tiny_model_dir: Path) -> None:
    if ql.unavailable() is not None:
        pytest.skip(ql.unavailable())
    runners = {m: ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=32, block_size=4, device="cpu",
                                              quantization=m) for m in ("int8", "none", "auto")}
    q, plain = runners["int8"].model, runners["none"].model
    assert q.lm_head is q.embed and not quant_weights(runners["auto"].model)  # auto: an HF folder loads as is
    pairs = list(zip(linears(q), linears(plain), strict=True))
    for (oq, attr), _ in pairs:
        w = getattr(oq, attr)
        assert isinstance(w, QuantWeight) and [s.qtype for s in w.segments] == [ql.INT8_ROW], attr
        assert w.nbytes == w.n * (w.k + 4)
    prompt = runners["none"].tokenizer.encode("The quick brown fox jumps over the lazy dog")
    tokens = torch.randint(0, q.config.vocab_size, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = (teacher_forced(runners[m], prompt, tokens) for m in ("int8", "none"))
    # each weight is within max|row| / 254 of its own (test_quant_linear.py), an rms error of ~0.23% of the
    # row's max; over 2 layers of 4 linears, the int8 token table and head that measured 3.5e-2 of the
    # largest |logit|, argmax the same at all 9 positions
    assert max_rel(got, want) < 0.08, max_rel(got, want)
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.75
    with torch.no_grad():  # the plain model on the int8 model's own (dequantized) weights: float32 equal
        for (oq, attr), (op, _) in pairs:
            getattr(op, attr).copy_(ql.dequantize(getattr(oq, attr)))
        plain.prepare(plain.ops)  # the packed copies the linears run on
    same = teacher_forced(runners["none"], prompt, tokens)
    assert max_rel(got, same) < SAME_WEIGHTS_TOL, max_rel(got, same)


def test_int8_mode_with_int8_activations_is_w8a8(tiny_model_dir: Path) -> None:
    """quantization int8 + int8_activations: every int8 weight (k = 64, 128: blocks of 32) marked, so its
    products are integer dots on int8-rounded inputs; the logits move off the weight-only ones, and stay close
    (measured 4.8e-2 of the largest |logit|)."""
    if ql.unavailable() is not None:
        pytest.skip(ql.unavailable())
    runners = {a: ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=32, block_size=4, device="cpu",
                                              quantization="int8", int8_activations=a) for a in (False, True)}
    w8a8 = runners[True].model
    assert all(getattr(o, a).int8_inputs for o, a in linears(w8a8))
    assert not any(w.int8_inputs for w in quant_weights(runners[False].model).values())
    prompt = runners[False].tokenizer.encode("The quick brown fox jumps over the lazy dog")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, w8a8.config.vocab_size, (8,), generator=g).tolist()
    got, want = (teacher_forced(runners[a], prompt, tokens) for a in (True, False))
    assert 1e-5 < max_rel(got, want) < 0.1, max_rel(got, want)  # rounded inputs (not float products), close


def test_unknown_mode_is_one_line_model_load_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        load_model(tiny_model_dir, quantization="int4")
    assert str(err.value) == "quantization 'int4' is not one of auto, none, int8"


def test_quantized_weights_run_on_the_cpu_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mixserve"):
        assert quantization.resolve("int8", torch.device("cuda")) == "none"
        assert quantization.resolve("none", torch.device("cuda")) == "none"
    assert len(caplog.records) == 1 and "CPU only" in caplog.records[0].getMessage()
    if ql.unavailable() is None:
        cpu = torch.device("cpu")
        assert [quantization.resolve(m, cpu) for m in quantization.MODES] == ["auto", "none", "int8"]


def no_kernel_type() -> gguf.GGMLQuantizationType | None:
    """A type gguf-py writes (rows of 64) that no kernel reads, if there is one."""
    T = gguf.GGMLQuantizationType
    for qtype in (T.Q5_0, T.Q5_1, T.MXFP4):
        if qtype not in ql.FORMATS:
            try:
                quants.quantize(np.ones((2, 64), np.float32), qtype)
                return qtype
            except NotImplementedError:
                continue
    return None


def test_gguf_of_mixed_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    if ql.unavailable() is not None:
        pytest.skip(ql.unavailable())
    T, other = gguf.GGMLQuantizationType, no_kernel_type()
    types = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q4_0, "attn_output": other or T.F32,
             "ffn_gate": T.F16, "ffn_up": T.F16, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}
    add = gguf.GGUFWriter.add_tensor

    def add_typed(self, name: str, tensor: np.ndarray, *args, **kwargs):  # the tiny GGUF, re-typed per tensor
        qtype = types.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0], T.F32)
        if qtype == T.F16:
            tensor = tensor.astype(np.float16)
        elif qtype != T.F32:
            tensor, kwargs["raw_dtype"] = quants.quantize(tensor, qtype), qtype
        return add(self, name, tensor, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_typed)
        path = make_tiny_llama(tmp_path, fmt="gguf")
    with caplog.at_level(logging.WARNING, logger="mixserve"):
        runners = {m: ModelRunner.from_pretrained(str(path), num_blocks=32, block_size=4, device="cpu",
                                                  quantization=m) for m in ("auto", "none")}
    said = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    if other is not None:  # one line for the type (two layers of it), naming it; floats load without a word
        assert len(said) == 1 and other.name in said[0] and str(path) in said[0], said
    else:
        assert not said
    model = runners["auto"].model
    assert model.embed.formats == ("Q8_0",) and model.lm_head is model.embed
    for layer in model.layers:
        assert layer.qkv.formats == ("Q8_0", "Q4_0") and len(layer.qkv.segments) == 2  # q and k fused as one
        assert layer.mlp.down.formats == ("Q8_0",)
        assert isinstance(layer.o_proj, torch.nn.Parameter) and layer.o_proj.dtype == torch.float32
        assert isinstance(layer.mlp.gate_up, torch.nn.Parameter)  # F16 loads as float, as before
    prompt = runners["none"].tokenizer.encode("Hello, world! How are you today?")
    tokens = [5, 77, 200, 3]
    got, want = (teacher_forced(runners[m], prompt, tokens) for m in ("auto", "none"))
    assert max_rel(got, want) < SAME_WEIGHTS_TOL, max_rel(got, want)  # K/Q rows un-permuted in blocks too


def test_config_key_and_flag() -> None:
    assert load_config().engine.quantization == "auto"
    with pytest.raises(ConfigError) as err:
        load_config(None, {"engine": {"quantization": "bogus"}})
    assert str(err.value) == "engine.quantization: must be one of auto, none, int8, got 'bogus'"
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert load_config(None, overrides_from_args(parser.parse_args(["--quantization", "int8"]))
                       ).engine.quantization == "int8"
    with pytest.raises(ConfigError, match="engine.quantization: must be one of"):
        load_config(None, overrides_from_args(parser.parse_args(["--quantization", "q4"])))
    with pytest.raises(ConfigError, match="quantization: must be one of"):
        LLM(None, quantization="fp4")
