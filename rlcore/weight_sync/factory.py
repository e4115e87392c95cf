"""The registry of transports and the one place that picks one (``rollout.weight_transport``).

A new transport: a file defining a ``transport.Transport`` subclass, and one ``register`` line below.
"""
from __future__ import annotations

import torch

from .broadcast import Broadcast
from .group import StageLink
from .plan import Bucket
from .shm import SharedMemory
from .transport import StageReader, StageWriter, Transport


class TransportRegistry:
    """Transports by name, in the order ``auto`` prefers them."""

    def __init__(self):
        self._by_name: dict[str, type[Transport]] = {}

    def register(self, transport: type[Transport]) -> type[Transport]:
        if transport.name == "auto":
            raise ValueError("weight sync transport name 'auto' is reserved: it means 'choose one'")
        if transport.name in self._by_name:
            raise ValueError(f"weight sync transport {transport.name!r} is already registered")
        self._by_name[transport.name] = transport
        return transport

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> type[Transport]:
        if name not in self._by_name:
            raise ValueError(f"weight sync transport {name!r}: expected {' or '.join(self._by_name)}")
        return self._by_name[name]

    def choose(self, asked: str, profile: str, nodes: set[str]) -> str:
        """The transport for ``rollout.weight_transport=asked`` when the members (actor and rollout)
        run on ``nodes`` under ``profile``: ``auto`` is the first registered one with ``auto`` set that
        can serve them; a forced one that cannot is a clear error."""
        if asked != "auto" and asked not in self._by_name:
            raise ValueError(f"rollout.weight_transport={asked!r}: expected one of {['auto', *self._by_name]}")
        if asked == "auto":
            for t in self._by_name.values():
                if t.auto and t.unusable(profile, nodes) is None:
                    return t.name
            raise ValueError(f"rollout.weight_transport=auto: no transport serves profile {profile}, "
                             f"nodes {sorted(nodes)}")
        reason = self._by_name[asked].unusable(profile, nodes)
        if reason is not None:
            raise ValueError(f"rollout.weight_transport={asked} {reason}; here: profile {profile}, "
                             f"nodes {sorted(nodes)}")
        return asked


REGISTRY = TransportRegistry()
REGISTRY.register(SharedMemory)  # auto's choice where it can serve (the cpu profile on one node)
REGISTRY.register(Broadcast)  # anywhere else

TRANSPORTS = ("auto", *REGISTRY.names())  # the values rollout.weight_transport accepts


def choose_transport(asked: str, profile: str, nodes: set[str]) -> str:
    return REGISTRY.choose(asked, profile, nodes)


def create_writer(transport: str, stage: int, host: str, port: int, tp: int, receivers: int,
                  plan: list[Bucket]) -> StageWriter:
    """The stage sender's writer for ``transport``; its ``link`` is what every member joins by."""
    return REGISTRY.get(transport).writer.create(stage, host, port, tp, receivers, plan)


def open_writer(link: StageLink, tp_rank: int, plan: list[Bucket]) -> StageWriter:
    """Another rank's writer for ``link`` (made by the stage sender's ``create_writer``)."""
    return REGISTRY.get(link.transport).writer(link, tp_rank, plan)


def open_reader(links: list[StageLink], ranks: list[int], plans: list[list[Bucket]], backend: str,
                device: str | torch.device, timeout_s: float) -> StageReader:
    """One vLLM worker's reader for every stage's group (``ranks[s]`` in ``links[s]``'s); joins them."""
    names = {link.transport for link in links}
    if len(names) != 1:
        raise ValueError(f"weight sync: the stage links use transports {sorted(names)}; expected one")
    return REGISTRY.get(names.pop()).reader(links, ranks, plans, backend, device, timeout_s)
