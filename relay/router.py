"""Namespace routing: which publishers announced a namespace that is a prefix of a track's namespace.

Owns: a tree of namespace fields (moxygen ``NamespaceNode``) holding the routes registered by
PUBLISH_NAMESPACE, and the draft's prefix rule (section "Publisher Interactions": fields are matched one by
one, exactly; an announced namespace with the same or fewer fields matches).

Does not know what a route is: ``R`` is any hashable handle (the server uses its publisher-session object),
so the router can be tested without a network.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Namespace = tuple[bytes, ...]
R = TypeVar("R", bound=Hashable)


class RouteLimitError(Exception):
    """Registering one more namespace would exceed the router's limit."""


@dataclass
class _Node(Generic[R]):
    children: dict[bytes, _Node[R]] = field(default_factory=dict)
    routes: dict[R, None] = field(default_factory=dict)
    """Insertion-ordered set: the first announcer is tried first."""


class NamespaceRouter(Generic[R]):
    """Routes by longest matching announced namespace prefix."""

    def __init__(self, max_routes: int = 100_000) -> None:
        self._root: _Node[R] = _Node()
        self._count = 0
        self._max_routes = max_routes

    def __len__(self) -> int:
        return self._count

    def add(self, namespace: Namespace, route: R) -> bool:
        """Register ``route`` for ``namespace``; False if it was already there."""
        node = self._root
        for part in namespace:
            node = node.children.setdefault(part, _Node())
        if route in node.routes:
            return False
        if self._count >= self._max_routes:
            raise RouteLimitError(f"relay holds the maximum of {self._max_routes} namespace routes")
        node.routes[route] = None
        self._count += 1
        return True

    def remove(self, namespace: Namespace, route: R) -> bool:
        """Withdraw one registration; prunes empty branches so withdrawn namespaces cost no memory."""
        path: list[tuple[_Node[R], bytes]] = []
        node = self._root
        for part in namespace:
            child = node.children.get(part)
            if child is None:
                return False
            path.append((node, part))
            node = child
        if route not in node.routes:
            return False
        del node.routes[route]
        self._count -= 1
        for parent, part in reversed(path):
            child = parent.children[part]
            if child.routes or child.children:
                break
            del parent.children[part]
        return True

    def remove_route(self, route: R) -> int:
        """Withdraw every namespace of ``route`` (its session ended); returns how many."""
        removed = 0
        for ns in [ns for ns, r in self.items() if r == route]:
            removed += self.remove(ns, route)
        return removed

    def lookup(self, namespace: Namespace) -> list[R]:
        """Routes whose namespace is a prefix of ``namespace``, longest prefix first, no duplicates."""
        found: list[list[R]] = []
        node = self._root
        if node.routes:
            found.append(list(node.routes))
        for part in namespace:
            child = node.children.get(part)
            if child is None:
                break
            node = child
            if node.routes:
                found.append(list(node.routes))
        out: dict[R, None] = {}
        for routes in reversed(found):
            for r in routes:
                out.setdefault(r, None)
        return list(out)

    def under(self, prefix: Namespace) -> Iterator[tuple[Namespace, R]]:
        """Registrations whose namespace starts with ``prefix`` (SUBSCRIBE_NAMESPACE discovery)."""
        node = self._root
        for part in prefix:
            child = node.children.get(part)
            if child is None:
                return
            node = child
        stack: list[tuple[Namespace, _Node[R]]] = [(prefix, node)]
        while stack:
            ns, n = stack.pop()
            for r in n.routes:
                yield ns, r
            for part, child in n.children.items():
                stack.append(((*ns, part), child))

    def items(self) -> Iterator[tuple[Namespace, R]]:
        return self.under(())
