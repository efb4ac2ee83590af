"""The README and docs/ as a new user meets them: snippets run, links and anchors resolve, and
the names, options and flags they list are the code's."""

from __future__ import annotations

import ast
import dataclasses
import graphlib
import inspect
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run(code: str, path: Path, scope: dict) -> dict:
    exec(compile(code, str(path), "exec"), scope)
    return scope


def test_quickstart_runs_and_expands_routes():
    blocks = python_blocks(README)
    assert len(blocks) == 1
    scope = run(blocks[0], README, {})
    batch, per_layer = scope["batch"], scope["per_layer"]
    assert batch["routed_experts"].total_rows == 21
    assert batch["routed_experts_valid"].values.sum() == 19  # the last token of each has no row
    assert len(per_layer) == 48
    assert all(t.shape[1] == 8 for t in per_layer)


def test_every_link_of_the_readme_names_a_file_of_the_checkout():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert {"docs/architecture.md", "docs/loader.md", "docs/benchmarks.md"} <= set(local)
    assert len([link for link in local if link.startswith("notebooks/")]) == 4
    missing = [link for link in local if not (README.parent / link).is_file()]
    assert not missing


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (headings in code blocks are not headings)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_and_anchor_of_the_docs_resolves():
    broken = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken


def test_the_payload_snippet_writes_reads_and_clips(tmp_path):
    (block,) = python_blocks(ROOT / "docs" / "formats-payload.md")
    root = f"memory://docs-{uuid.uuid4().hex}/run-7/payloads"
    assert block.count('"s3://bucket/run-7/payloads"') == 2
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 128, (20, 48, 8), dtype=np.uint8)
    masks = [rng.integers(0, 1000, n).astype(np.int32) for n in (3, 0, 5)]
    scope = {
        "policy_version": 3,
        "routes": routes,
        "kept_ids_per_token": masks,
        "route_pos": 0,
        "prompt_len": 17,
        "response": {},
        "lo": 5,
        "hi": 12,
        "batch_buffer": np.zeros((32, 48, 8), np.uint8),
        "a": 10,
        "b": 17,
    }
    code = block.replace('"s3://bucket/run-7/payloads"', repr(root)).replace(
        "reader.read_into(", "segments_of_routes = segments[:1]\nreader.read_into("
    )
    scope = run(code, ROOT / "docs" / "formats-payload.md", scope)
    np.testing.assert_array_equal(scope["batch_buffer"][10:17], routes[5:12])
    fields = scope["fields"]
    np.testing.assert_array_equal(fields["routed_experts"], routes)
    assert fields["sampling_mask"].lengths.tolist() == [3, 0, 5]
    assert scope["response"]["payload"][1]["pos"] == 17


def test_the_trace_snippet_stitches_and_materialises():
    from r3data.ragged import RaggedRows
    from r3data.wire.rows import InlineRows

    (block,) = python_blocks(ROOT / "docs" / "formats-trace.md")
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 128, (9, 48, 8), dtype=np.uint8)
    masks = RaggedRows.from_rows([np.arange(n, dtype=np.int32) for n in (3, 0, 2, 1)])
    scope = {
        "prompt_len": 6,
        "completion_len": 4,
        "routes_rows": InlineRows("routed_experts", rows, 0),
        "mask_rows": InlineRows("sampling_mask", masks, 6),
        "sample_len": 10,
        "reader": None,
    }
    scope = run(block.replace("...\n", ""), ROOT / "docs" / "formats-trace.md", scope)
    assert scope["sample"].valid.tolist() == [True] * 9 + [False]
    np.testing.assert_array_equal(scope["routes"][:9], rows)
    np.testing.assert_array_equal(scope["routes"][9], rows[8])  # the placeholder repeats


def test_the_hugging_face_snippet_replays_a_loader_batch():
    transformers = pytest.importorskip("transformers")
    import torch

    from r3data.wire import pack_ndarray

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    rng, samples = np.random.default_rng(0), []
    for i, (prompt, completion) in enumerate([(5, 3), (9, 4)] * 4):
        picks = [rng.permutation(8)[:2] for _ in range((prompt + completion - 1) * 2)]
        rows = np.stack(picks).reshape(-1, 2, 2).astype(np.uint8)
        response = {"choices": [{"routed_experts": pack_ndarray(rows, start=0)}]}
        request = {
            "prompt_len": prompt,
            "completion_len": completion,
            "sources": [{"producer": "prime-rl", "response": response}],
        }
        tokens = rng.integers(0, 64, prompt + completion)
        samples.append({"id": f"r{i}", "token_ids": tokens, "requests": [request]})
    logged = []
    scope = {
        "samples": samples,
        "model": model,
        "loss_fn": lambda logits, mask: (logits.mean(-1) * mask).sum(),
        "log": logged.append,
    }
    block = python_blocks(ROOT / "docs" / "huggingface.md")[0]  # the FSDP2 one needs ranks
    scope = run(block, ROOT / "docs" / "huggingface.md", scope)
    real_rows = sum(len(s["token_ids"]) - 1 for s in samples)  # the last tokens: placeholders
    assert [entry["tokens"] for entry in logged] == [real_rows]
    assert scope["batch"].metadata["agreement"] is not None
    assert all(p.grad is not None for p in model.model.layers[0].mlp.gate.parameters())


def option_names(text: str, cls) -> None:
    """``cls(a, b, ...)`` as the docs write it names exactly the dataclass's fields."""
    found = re.findall(rf"`{cls.__name__}\(([a-z_, ]+)\)`", text)
    assert found, cls.__name__
    for listed in found:
        assert [n.strip() for n in listed.split(",")] == [f.name for f in dataclasses.fields(cls)]


def test_the_loader_options_are_the_loaders():
    from r3data import loader
    from r3data.nodes import CollateOptions, ScreenOptions, TraceOptions

    text = (ROOT / "docs" / "loader.md").read_text()
    options = text.split("## Options")[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \|", options, flags=re.M))
    documented = {name for pair in listed for name in pair if name}
    assert documented == set(inspect.signature(loader).parameters) - {"samples"}
    for cls in (TraceOptions, CollateOptions):
        option_names(text, cls)
    assert "`ScreenOptions(zero_rows)`" in text  # num_experts is the loader's own
    assert {f.name for f in dataclasses.fields(ScreenOptions)} == {"num_experts", "zero_rows"}


def test_the_layout_fields_are_the_layouts():
    from r3data.layout import ModelLayers, TokenLayout

    text = (ROOT / "docs" / "megatron.md").read_text()
    (listed,) = re.findall(r"Its fields are `([a-z_, \n]+)`", text)
    assert [n.strip() for n in listed.split(",")] == [
        f.name for f in dataclasses.fields(TokenLayout)
    ]
    option_names(text, ModelLayers)


def test_every_flag_of_the_cli_docs_is_the_commands():
    from r3data.cli import COMMANDS, build_parser

    text = (ROOT / "docs" / "cli.md").read_text()
    subparsers = next(a for a in build_parser()._actions if a.choices and "demo" in a.choices)
    for command in COMMANDS:
        (synopsis,) = re.findall(rf"```\n(r3data {command} .*?)```", text, flags=re.S)
        flags = {o for a in subparsers.choices[command]._actions for o in a.option_strings}
        assert set(re.findall(r"--[a-z-]+", synopsis)) == flags - {"-h", "--help"}, command


PACKAGES = [
    {"errors"},
    {"validate"},
    {"spans"},
    {"options"},
    {"ragged"},
    {"segmented", "packed", "packed_ragged", "batch", "tensor_buffer"},
    {"buffers"},
    {"parallel"},
    {"wire"},
    {"payload"},
    {"trace"},
    {"layout"},
    {"nodes"},
    {"replay"},
    {"synth", "cli", "benchmarking"},
]
"""docs/architecture.md's table, top to bottom: a package imports only those above it."""


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_architecture_import_rules_hold():
    modules = {}
    for path in (ROOT / "r3data").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    rank = {name: i for i, group in enumerate(PACKAGES) for name in group}
    upward, graph = [], {}
    for module, path in modules.items():
        found = imports(path)
        graph[module] = {n for n in found if n in modules and n != module}
        package = module.split(".")[1] if "." in module else ""
        for other in {n.split(".")[1] for n in graph[module] if n != "r3data"}:
            if package and other != package and rank[other] > rank[package]:
                upward.append(f"{module} -> r3data.{other}")
        third = {n.split(".")[0] for n in found}
        where = path.relative_to(ROOT).as_posix()
        assert "transformers" not in third, where
        if "megatron" in third:
            assert where.startswith("r3data/replay/megatron"), where
        if "torchdata" in third:
            assert where.startswith("r3data/nodes/"), where
        if package == "layout":
            assert not third & {"json", "orjson", "os", "fsspec", "pathlib"}, where
    assert set(rank) == {m.split(".")[1] for m in modules if "." in m}
    assert not upward
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a circle


def test_the_formats_sources_and_sample_load():
    import r3data
    from r3data.errors import ConfigError
    from r3data.wire.producers import FORMATS, EngineRequest

    page = ROOT / "docs" / "formats.md"
    sources, sample_block = python_blocks(page)
    for line in sources.strip().splitlines():
        source = eval(line, {"raw_body": b"{}", "decode_body": b"{}"})
        FORMATS[source.pop("producer")].make_options(source, skip=("response",))
    with pytest.raises(ConfigError, match="'start'"):
        FORMATS["vllm"].make_options({"strat": 1})

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 1484 + 79)
    routes = rng.integers(0, 128, (1484 + 79 - 1, 48, 8), dtype=np.uint8)

    def body(prompt: int, completion: int, start: int) -> bytes:
        ids = tokens[: prompt + completion].tolist()
        rows = routes[start : prompt + completion - 1]
        return FORMATS["vllm"].encode(EngineRequest(ids[:prompt], ids[prompt:], rows, start=start))

    scope = {"raw_body": body(1484, 79, 1401)}
    code = "sample = " + sample_block
    for key, value in (("token_ids", "tokens"), ("loss_mask", "mask"), ("logprobs", "logps")):
        code = code.replace(f'"{key}": [...]', f'"{key}": {value}')
    scope |= {"tokens": tokens, "mask": [True] * tokens.size, "logps": np.zeros(tokens.size)}
    sample = run(code, page, scope)["sample"]
    earlier = {"producer": "vllm", "response": body(1300, 102, 0)}
    sample["requests"].insert(0, {"prompt_len": 1300, "completion_len": 102, "sources": [earlier]})
    (batch,) = r3data.loader([sample], batch_size=1, num_experts=128)
    np.testing.assert_array_equal(batch["routed_experts"].values[:-1].numpy(), routes)
    assert batch["routed_experts_valid"].values.sum() == routes.shape[0]
    assert batch["sample_id"] == ["rollout-17"]


def test_the_megatron_snippet_replays_every_micro_batch():
    pytest.importorskip("megatron.core")
    import warnings

    import torch

    import r3data
    from r3data.replay import megatron_check
    from r3data.wire import pack_ndarray

    rng, samples = np.random.default_rng(0), []
    for i, n in enumerate((7, 12, 9, 5)):
        picks = [rng.permutation(8)[:2] for _ in range((n - 1) * 2)]
        rows = np.stack(picks).reshape(n - 1, 2, 2).astype(np.uint8)
        response = {"choices": [{"routed_experts": pack_ndarray(rows, start=0)}]}
        source = {"producer": "prime-rl", "response": response}
        request = {"prompt_len": 3, "completion_len": n - 3, "sources": [source]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    (batch,) = r3data.loader(samples, batch_size=4)
    routed = []

    def model(*_):
        """Each router routes fresh logits of the installed routes' tokens."""
        losses = []
        for router in routers:
            installed = router.router_replay.target_topk_idx
            logits = torch.randn(installed.shape[0], 8, requires_grad=True)
            probs, routing_map = router.routing(logits)
            routed.append(
                torch.equal(
                    routing_map.nonzero()[:, 1].view(-1, 2).sort(1).values, installed.sort(1).values
                )
            )
            losses.append(probs.sum())
        return sum(losses)

    (block,) = python_blocks(ROOT / "docs" / "megatron.md")
    with warnings.catch_warnings(), megatron_check._single_rank():
        warnings.simplefilter("ignore")
        config, routers = megatron_check._routers(2, 8, 2, 2)
        try:
            scope = {"config": config, "micro_batches": batch.chunk(2), "device": "cpu"}
            run(block, ROOT / "docs" / "megatron.md", scope | {"model": model})
        finally:
            megatron_check._forget(routers)
    assert routed == [True] * 4  # 2 micro-batches x 2 routers, each as installed


def calls(code: str) -> dict[str, set[str]]:
    """Each called name of ``code`` and the keywords it is called with."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            found.setdefault(name, set()).update(k.arg for k in node.keywords if k.arg)
    return found


def test_the_loader_page_loop_is_the_examples():
    block = python_blocks(ROOT / "docs" / "loader.md")[0]  # "A trainer's loop", the page's first
    documented = calls(block)
    example = calls((ROOT / "examples" / "trainer_loop.py").read_text())
    for name in (
        "PayloadRetention",
        "loader",
        "MicroBatches",
        "DataParallel.from_torch",
        "TokenLayout",
    ):
        assert documented[name] == example[name], name
    assert {"expand", "retention.on_policy_update", "optimizer.step"} <= set(documented)
