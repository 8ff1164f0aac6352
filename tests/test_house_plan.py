"""The house plan (docs/architecture.md): floors that only look down. A module imports from its own floor or the ones
below, never from above; services on one floor do not import each other. Every import counts, also a deferred one:
it is the same dependency, only hidden from the interpreter."""

from __future__ import annotations

import pytest

from tests.test_import_cycles import import_graph

# The project's packages, lowest first. A tuple is one floor.
PROJECT_FLOORS = [
    # the ground floor: generated stubs, the code every service shares, and the native sources with their builder
    ("kimiserve", "native"),
    ("router", "tokenizer_svc", "shard_svc"),  # the services, each standing on the ground floor alone
    ("launcher",),  # the `kimiserve` command: starts, drives and measures the services
]
# Inside the shard, lowest first: what every part needs, the kernels, the model and its weights, the memory it runs
# in, the engine that schedules it, then what composes engines into processes and servers.
SHARD_FLOORS = [
    ("shard_svc.errors", "shard_svc.config_values", "shard_svc.config", "shard_svc.host_memory"),
    ("shard_svc.ops",),
    ("shard_svc.forward_batch", "shard_svc.model", "shard_svc.checkpoint"),
    ("shard_svc.state", "shard_svc.weight_streaming"),
    ("shard_svc.engine",),
    ("shard_svc.parallel",),
    # build: one process or a shard group, chosen above both, so the engine never knows about groups
    ("shard_svc.server", "shard_svc.build", "shard_svc.generate", "shard_svc.make_tiny"),
]


def _unit(module: str, floors: list[tuple[str, ...]]) -> tuple[int, str] | None:
    for level, names in enumerate(floors):
        for name in names:
            if module == name or module.startswith(name + "."):
                return level, name
    return None


def _violations(floors: list[tuple[str, ...]], siblings_may_meet: bool) -> list[str]:
    found = []
    for module, deps in sorted(import_graph().items()):
        here = _unit(module, floors)
        if here is None:
            continue
        for dep in sorted(deps):
            there = _unit(dep, floors)
            if there is None or there[1] == here[1]:
                continue
            if there[0] > here[0] or (there[0] == here[0] and not siblings_may_meet):
                found.append(f"{module} (floor {here[0]}) imports {dep} (floor {there[0]})")
    return found


def test_packages_only_look_down():
    found = _violations(PROJECT_FLOORS, siblings_may_meet=False)
    assert not found, "imports against the house plan:\n" + "\n".join(found)


def test_every_project_module_has_a_floor():
    lost = [m for m in import_graph() if _unit(m, PROJECT_FLOORS) is None]
    assert not lost, f"modules on no floor: {lost}"


def test_shard_floors_only_look_down():
    found = _violations(SHARD_FLOORS, siblings_may_meet=True)
    assert not found, "imports against the shard's floors:\n" + "\n".join(found)


def test_every_shard_module_has_a_floor():
    lost = [m for m in import_graph() if m.startswith("shard_svc.") and _unit(m, SHARD_FLOORS) is None]
    assert not lost, f"shard modules on no floor: {lost}"


@pytest.mark.parametrize("floors", [PROJECT_FLOORS, SHARD_FLOORS])
def test_a_floor_is_named_once(floors):
    names = [n for floor in floors for n in floor]
    assert len(names) == len(set(names))
