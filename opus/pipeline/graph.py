"""The stage DAG: built with networkx and validated before anything runs."""

from __future__ import annotations

import networkx as nx
from pydantic import BaseModel, ValidationError

from opus.pipeline.registry import StageType, UnknownStageType, load_stage_type
from opus.pipeline.spec import LoadedPipeline


def build_graph(loaded: LoadedPipeline) -> nx.DiGraph:
    """Nodes are stage ids in declaration order; an edge runs from a need to its dependant."""
    graph = nx.DiGraph()
    seen: set[str] = set()
    for index, stage in enumerate(loaded.spec.stages):
        if stage.id in seen:
            raise loaded.error(f"duplicate stage id '{stage.id}'", ("stages", index, "id"))
        seen.add(stage.id)
        graph.add_node(stage.id, index=index)
    for index, stage in enumerate(loaded.spec.stages):
        for need_index, need in enumerate(stage.needs):
            if need not in seen:
                raise loaded.error(f"needs '{need}', which names no stage (stages: {', '.join(graph)})",
                                   ("stages", index, "needs", need_index))
            graph.add_edge(need, stage.id)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return graph
    names = [edge[0] for edge in cycle] + [cycle[0][0]]
    first = loaded.stage_loc(names[0])
    raise loaded.error(f"the needs form a cycle: {' -> '.join(names)}", (*first, "needs"))


def execution_order(graph: nx.DiGraph) -> list[str]:
    """Topological order, ties broken by declaration order so runs are reproducible."""
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["index"]))


def ancestors(graph: nx.DiGraph, stage_id: str) -> list[str]:
    return [n for n in execution_order(graph) if n in nx.ancestors(graph, stage_id)]


def resolve_stage_types(loaded: LoadedPipeline) -> dict[str, tuple[StageType, BaseModel]]:
    """Load every stage type and validate its ``with`` block; errors name the line and key."""
    resolved: dict[str, tuple[StageType, BaseModel]] = {}
    for index, stage in enumerate(loaded.spec.stages):
        try:
            stage_type = load_stage_type(stage.uses)
        except UnknownStageType as exc:
            raise loaded.error(str(exc), ("stages", index, "uses")) from None
        try:
            cfg = stage_type.config_class.model_validate(stage.with_)
        except ValidationError as exc:
            raise loaded.invalid(exc, ("stages", index, "with"), f"stage type '{stage.uses}'") from None
        resolved[stage.id] = (stage_type, cfg)
    return resolved


def validate(loaded: LoadedPipeline) -> tuple[nx.DiGraph, dict[str, tuple[StageType, BaseModel]]]:
    graph = build_graph(loaded)
    return graph, resolve_stage_types(loaded)
