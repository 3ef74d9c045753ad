"""Which PUBLIC anvil dev account plays which role. DEV ONLY: these keys are derived from anvil's well-known
mnemonic and published everywhere; never use them on a real network."""

from __future__ import annotations

from dataclasses import dataclass

DEPLOYER = 0
TRAINER = 1
FIRST_VALIDATOR = 2


@dataclass(frozen=True)
class Accounts:
    validators: int
    nodes: int

    @property
    def total(self) -> int:
        """Accounts anvil must create."""
        return FIRST_VALIDATOR + self.validators + self.nodes

    def validator(self, i: int) -> int:
        return FIRST_VALIDATOR + i

    def node(self, i: int) -> int:
        return FIRST_VALIDATOR + self.validators + i


def dev_address(index: int) -> str:
    from contracts.devchain import dev_identity

    return dev_identity(index).address


def dev_key_hex(index: int) -> str:
    """DEV ONLY: the PUBLIC anvil private key `index`, hex (handed to a role through its environment)."""
    from contracts.devchain import dev_key

    return "0x" + dev_key(index).hex()
