// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {ERC20} from "@openzeppelin/contracts/token/ERC20/ERC20.sol";

/// Receives a call after every transfer of HookToken to it (the ERC-777 / ERC-1363 pattern).
interface ITokenReceiver {
    function onTokenReceived(address from, uint256 amount) external;
}

/// @title HookToken (TEST ONLY): an ERC-20 that calls the recipient back after each transfer.
/// @notice Plain ERC-20 has no hooks, but a pool may be deployed with a token that has them (ERC-777,
/// ERC-1363, fee tokens with callbacks). The hook gives a receiving contract control in the middle of the
/// pool's payout, which is exactly the window a reentrancy attack needs.
contract HookToken is ERC20 {
    constructor() ERC20("Hook Token", "HOOK") {}

    function mint(address to, uint256 amount) external {
        _mint(to, amount);
    }

    function _update(address from, address to, uint256 value) internal override {
        super._update(from, to, value);
        if (from != address(0) && to.code.length > 0) {
            // Receivers without the hook (the pool itself) are fine, as with ERC-777's optional hook.
            try ITokenReceiver(to).onTokenReceived(from, value) {} catch {}
        }
    }
}
