"""The registry of transports and the one place that picks one (``rollout.weight_transport``).

A new transport: a file defining a ``transport.Transport`` subclass, and its import and ``register``
line below (registration order is ``auto``'s order of preference).
"""
from __future__ import annotations

import torch

from rlcore.registry import Registry

from .broadcast import Broadcast
from .group import StageLink
from .plan import Bucket
from .shm import SharedMemory
from .transport import StageReader, StageWriter, Transport


REGISTRY: Registry[type[Transport]] = Registry("rollout.weight_transport")  # in the order auto prefers them


def register(transport: type[Transport], registry: Registry = REGISTRY) -> type[Transport]:
    if transport.name == "auto":
        raise ValueError("weight sync transport name 'auto' is reserved: it means 'choose one'")
    return registry.add(transport.name, transport)


register(SharedMemory)  # auto's choice where it can serve (the cpu profile on one node)
register(Broadcast)  # anywhere else

TRANSPORTS = ("auto", *REGISTRY)  # the values rollout.weight_transport accepts


def choose_transport(asked: str, profile: str, nodes: set[str]) -> str:
    """The transport for ``rollout.weight_transport=asked`` when the members (actor and rollout) run
    on ``nodes`` under ``profile``: ``auto`` is the first registered one with ``auto`` set that can
    serve them; a forced one that cannot is a clear error."""
    if asked not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={asked!r}: expected one of {list(TRANSPORTS)}")
    if asked == "auto":
        for t in REGISTRY.values():
            if t.auto and t.unusable(profile, nodes) is None:
                return t.name
        raise ValueError(f"rollout.weight_transport=auto: no transport serves profile {profile}, "
                         f"nodes {sorted(nodes)}")
    reason = REGISTRY[asked].unusable(profile, nodes)
    if reason is not None:
        raise ValueError(f"rollout.weight_transport={asked} {reason}; here: profile {profile}, nodes {sorted(nodes)}")
    return asked


def create_writer(transport: str, stage: int, host: str, port: int, tp: int, receivers: int,
                  plan: list[Bucket]) -> StageWriter:
    """The stage sender's writer for ``transport``; its ``link`` is what every member joins by."""
    return REGISTRY[transport].writer.create(stage, host, port, tp, receivers, plan)


def open_writer(link: StageLink, tp_rank: int, plan: list[Bucket]) -> StageWriter:
    """Another rank's writer for ``link`` (made by the stage sender's ``create_writer``)."""
    return REGISTRY[link.transport].writer(link, tp_rank, plan)


def open_reader(links: list[StageLink], ranks: list[int], plans: list[list[Bucket]], backend: str,
                device: str | torch.device) -> StageReader:
    """One vLLM worker's reader for every stage's group (``ranks[s]`` in ``links[s]``'s); joins them
    (each within its link's ``timeout_s``)."""
    names = {link.transport for link in links}
    if len(names) != 1:
        raise ValueError(f"weight sync: the stage links use transports {sorted(names)}; expected one")
    return REGISTRY[names.pop()].reader(links, ranks, plans, backend, device)
