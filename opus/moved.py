"""Module paths from before the package layout of issue 14, and where each module lives now.

Checkpoints, exports and kv_config artifacts name modules by path (a KV cache's ``provider``, a recipe
step's provider); those written before the move name the old flat modules. Everything that imports a
module named in a file on disk goes through ``import_module`` here, so old runs keep loading.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from opus import trust

OLD_TO_NEW = {
    "opus.spec": "opus.pipeline.spec",
    "opus.yaml_lines": "opus.pipeline.yaml_lines",
    "opus.graph": "opus.pipeline.graph",
    "opus.registry": "opus.pipeline.registry",
    "opus.runner": "opus.pipeline.runner",
    "opus.worker": "opus.pipeline.worker",
    "opus.supervise": "opus.pipeline.supervise",
    "opus.stage": "opus.pipeline.context",
    "opus.state": "opus.pipeline.state",
    "opus.checkpoint": "opus.pipeline.checkpoint",
    "opus.keys": "opus.pipeline.keys",
    "opus.fingerprint": "opus.pipeline.fingerprint",
    "opus.gates": "opus.pipeline.gates",
    "opus.summary": "opus.pipeline.summary",
    "opus.events": "opus.pipeline.events",
    "opus.lock": "opus.pipeline.lock",
    "opus.verdict": "opus.pipeline.verdict",
    "opus.verify": "opus.pipeline.verify",
    "opus.preflight": "opus.pipeline.preflight",
    "opus.preflight_model": "opus.pipeline.preflight_model",
    "opus.replay": "opus.pipeline.replay",
    "opus.console": "opus.cli.run_display",
    "opus.run_progress": "opus.pipeline.progress",
    "opus.transforms": "opus.recipe",
    "opus.engine": "opus.runtime.engine",
    "opus.metrics": "opus.runtime.metrics",
    "opus.profiling": "opus.runtime.profiling",
    "opus.data": "opus.runtime.data",
    "opus.export": "opus.export.native",
    "opus.noise": "opus.runtime.noise",
    "opus.choose": "opus.runtime.timed_choice",
    "opus.kvcache": "opus.kv.cache",
    "opus.kvpool": "opus.kv.pool",
    "opus.static_cache": "opus.kv.static",
    "opus.gpu.kv": "opus.kv.cuda_graph",
    "opus.report": "opus.report.document",
    "opus.plots": "opus.report.plots",
    "opus.profile_plot": "opus.report.plots",
    "opus.publish": "opus.report.publish",
    "opus.history": "opus.report.history",
    "opus.compare": "opus.report.compare",
    "opus.cli": "opus.cli.main",
    "opus.bench_cli": "opus.cli.bench",
    "opus.history_cli": "opus.cli.history",
    "opus.inspect_runs": "opus.cli.inspect",
    "opus.doctor": "opus.cli.doctor",
    "opus.quant.planner": "opus.quant.knapsack",
    "opus.quant.planning": "opus.quant.plan",
    # Renamed so that each name says which module it is (issue 50).
    "opus.export.hf": "opus.export.hf_compressed",
    "opus.quant.native": "opus.quant.cpp_kernels",
    "opus.serve.engine": "opus.serve.scheduler",
    "opus.serve.metrics": "opus.serve.prometheus",
    "opus.fusion.as_run": "opus.fusion.ready_to_time",
    "opus.quant.suffix": "opus.quant.suffix_trials",
    "opus.runtime.choose": "opus.runtime.timed_choice",
    "opus.gpu.qlinear": "opus.bench.static_path.qlinear",
    "opus.fusion.fast_decoder": "opus.bench.static_path.fast_decoder",
    "opus.fusion.static_runner": "opus.bench.static_path.runner",
    "opus.fusion.fidelity": "opus.bench.static_path.fidelity",
}


def current_name(module_name: str) -> str:
    """The module's path today: an old path maps to its new home, anything else is returned as is."""
    return OLD_TO_NEW.get(module_name, module_name)


def import_module(module_name: str, what: str = "a record") -> ModuleType:
    """Import a module named in a file on disk (``what`` names the field, for the refusal): while a run or an
    export is being loaded, only what opus.trust allows."""
    name = current_name(module_name)
    trust.check_import(name, what)
    return importlib.import_module(name)
