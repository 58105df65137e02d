"""The rooms of ``opus`` and which way imports run (docs/layout.md): a module never imports a room above its own."""

from __future__ import annotations

import pkgutil

import opus
from opus.pipeline.code_reach import imports_of

# Lower first. A room may import its own modules and any room below it, never one above.
# opus.api (opus.run, opus.load) is the top: it drives the command line's own run.
ROOMS = ["opus.errors", "opus.atomic", "opus.trust", "opus.moved", "opus.recipe", "opus.cpp_build",
         "opus.compile_watch", "opus.models", "opus.kv",
         "opus.runtime", "opus.cluster", "opus.quant", "opus.fusion", "opus.pipeline", "opus.export",
         "opus.made", "opus.harness", "opus.terminal", "opus.report", "opus.bench", "opus.serve", "opus.cli",
         "opus.api"]
SAME_LEVEL = {"opus.report": 0, "opus.bench": 0}  # neither imports the other


def _room(module: str) -> str | None:
    return next((r for r in sorted(ROOMS, key=len, reverse=True) if module == r or module.startswith(r + ".")),
                None)


def _level(room: str) -> int:
    return ROOMS.index("opus.report") if room in SAME_LEVEL else ROOMS.index(room)


def test_every_module_lives_in_a_room() -> None:
    modules = [m.name for m in pkgutil.walk_packages(opus.__path__, "opus.")]
    assert [m for m in modules if _room(m) is None] == []


def test_imports_run_downwards_only() -> None:
    upward = []
    for info in pkgutil.walk_packages(opus.__path__, "opus."):
        room = _room(info.name)
        for imported in imports_of(info.name):
            target = _room(imported)
            if target and target != room and (_level(target) > _level(room) or
                                              (target in SAME_LEVEL and room in SAME_LEVEL)):
                upward.append(f"{info.name} -> {imported}")
    assert upward == []


def test_opus_never_imports_the_stage_types() -> None:
    """Stage types import opus, never the reverse (the brief's rule)."""
    found = [f"{m.name} -> {i}" for m in pkgutil.walk_packages(opus.__path__, "opus.")
             for i in imports_of(m.name) if i == "stages" or i.startswith("stages.")]
    assert found == []


def test_an_export_takes_a_model_and_its_recipe_never_a_run_directory() -> None:
    """Reading run directories and checkpoints is the run engine's and opus.made's (above both), not an export's:
    a model as base + recipe + tensors is opus.models.saved_state, below both."""
    found = [f"{m.name} -> {i}" for m in pkgutil.walk_packages(opus.__path__, "opus.")
             if m.name.startswith("opus.export") for i in imports_of(m.name) if i.startswith("opus.pipeline")]
    assert found == []


def test_the_export_targets_import_no_circle() -> None:
    """The export directory (native) calls the targets; what they share is below them (settings, onnx_graph)."""
    import networkx as nx

    graph = nx.DiGraph()
    for m in pkgutil.walk_packages(opus.__path__, "opus."):
        if m.name.startswith("opus.export"):
            graph.add_node(m.name)
            graph.add_edges_from((m.name, i) for i in imports_of(m.name) if i.startswith("opus.export."))
    assert list(nx.simple_cycles(graph)) == []


def test_no_module_imports_another_modules_private_names() -> None:
    """A leading underscore says "this module's own": what another module needs gets a public name."""
    import ast

    found = []
    for m in pkgutil.walk_packages(opus.__path__, "opus."):
        origin = _source(m.name)
        for node in ast.walk(ast.parse(origin.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opus"):
                found += [f"{m.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_module_names_say_which_one() -> None:
    """Names the structure review found twice (two engine.py, two metrics.py, two hf.py, two native.py) name
    one module each, and no module is named for how it is used rather than what it is."""
    names = [m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(opus.__path__, "opus.")]
    assert {n: names.count(n) for n in ("engine", "metrics", "hf", "native") if names.count(n) > 1} == {}
    assert {"as_run", "suffix", "choose"} & set(names) == set()


def _source(module: str):  # noqa: ANN202 - a Path
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin)


def test_the_runtime_reads_text_sets_without_the_run_engine() -> None:
    """The pipeline file's text-set spec lives below both (opus.runtime.text_set)."""
    found = [f"{m.name} -> {i}" for m in pkgutil.walk_packages(opus.__path__, "opus.")
             if m.name.startswith("opus.runtime") for i in imports_of(m.name) if i.startswith("opus.pipeline")]
    assert found == []


def test_the_yaml_error_line_is_written_once() -> None:
    """pydantic's complaint becomes `file:line: key: message` in one place (LoadedPipeline.invalid)."""
    import inspect

    from opus.pipeline import graph, spec

    sources = inspect.getsource(graph) + inspect.getsource(spec)
    assert sources.count('"extra_forbidden"') == 1


def test_the_run_engine_draws_nothing_and_prints_nothing() -> None:
    """The runner tells observers (opus.pipeline.events.RunObserver); the terminal's bars and lines are
    opus.cli.run_display's, progress.json is the engine's ProgressFile. Only a stage's own log line
    (the worker's context) writes to stderr, which the runner's supervisor captures."""
    import ast

    drawing, printing = [], []
    for m in pkgutil.walk_packages(opus.__path__, "opus."):
        if not m.name.startswith("opus.pipeline"):
            continue
        drawing += [f"{m.name} -> {i}" for i in imports_of(m.name)
                    if i == "rich" or i.startswith(("rich.", "opus.terminal"))]
        tree = ast.parse(_source(m.name).read_text())
        printing += [f"{m.name}:{node.lineno}" for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
                     and m.name != "opus.pipeline.context"]
    assert drawing == [] and printing == []


def test_a_formats_kernel_choices_are_asked_for_never_named() -> None:
    """W8A8's kernel settings are the format's (Format.kernel_choices, opus.kv.kernel_choices): the caches,
    kv_config, the exports and the server ask the registries. Only the W8A8 experts' own C++ op and the
    bench's static path, which are W8A8 kernels themselves, import the format's module."""
    kernels_themselves = {"opus.fusion.native_experts", "opus.bench.static_path.qlinear"}
    found = {m.name for m in pkgutil.walk_packages(opus.__path__, "opus.")
             if not m.name.startswith("opus.quant")
             for i in imports_of(m.name) if i.startswith("opus.quant.formats.w8a8")}
    assert found == kernels_themselves
