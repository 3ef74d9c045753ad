"""The node's errors: one root (`NodeError`) under the project's `PrimeError`."""

from __future__ import annotations

from protocol.errors import PrimeError


class NodeError(PrimeError):
    """The node cannot go on (a message for the operator says why and what to do)."""

    code = "node"


class DoubleSignError(NodeError):
    """Signing this payload would sign a second, different payload for an assignment already signed."""

    code = "double_sign"


class ProtectionImportError(NodeError):
    """A slashing-protection interchange file is malformed or conflicts with the local record."""

    code = "protection_import"


class NodeStopped(NodeError):
    """The work loop stopped on purpose: a hard rejection, an inactive node, a misconfiguration."""

    code = "node_stopped"
