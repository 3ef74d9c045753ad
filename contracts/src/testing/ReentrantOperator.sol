// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";

interface IComputePool {
    function register(address node, uint256 amount, uint256 deadline, bytes calldata signature) external;
    function leavePool(address node) external;
    function withdraw(address node) external;
    function claimRewards(address node, bytes32[] calldata workKeys) external;
}

/// @title ReentrantOperator (TEST ONLY): a node operator contract that re-enters the pool from the token hook.
/// @notice When the pool pays it (withdraw or claimRewards), HookToken calls onTokenReceived, and this
/// contract immediately calls the same pool function again to be paid twice. It records whether the
/// re-entry succeeded and the revert data it got, so a test can show the guard stopped it.
contract ReentrantOperator {
    enum Attack {
        None,
        Withdraw,
        Claim
    }

    IComputePool public immutable pool;
    IERC20 public immutable token;
    Attack public attack;
    address public node;
    bytes32[] private _keys;

    uint256 public reentryAttempts;
    uint256 public reentrySuccesses;
    bytes public lastReentryError;

    constructor(IComputePool pool_, IERC20 token_) {
        pool = pool_;
        token = token_;
    }

    function register(address node_, uint256 amount, uint256 deadline, bytes calldata signature) external {
        node = node_;
        token.approve(address(pool), amount);
        pool.register(node_, amount, deadline, signature);
    }

    function leavePool() external {
        pool.leavePool(node);
    }

    function arm(Attack attack_, bytes32[] calldata keys) external {
        attack = attack_;
        _keys = keys;
    }

    function withdraw() external {
        pool.withdraw(node);
    }

    function claim(bytes32[] calldata keys) external {
        pool.claimRewards(node, keys);
    }

    function onTokenReceived(address, uint256) external {
        if (msg.sender != address(token) || attack == Attack.None) return;
        Attack current = attack;
        attack = Attack.None; // one attempt per payout
        reentryAttempts += 1;
        if (current == Attack.Withdraw) {
            try pool.withdraw(node) {
                reentrySuccesses += 1;
            } catch (bytes memory reason) {
                lastReentryError = reason;
            }
        } else {
            try pool.claimRewards(node, _keys) {
                reentrySuccesses += 1;
            } catch (bytes memory reason) {
                lastReentryError = reason;
            }
        }
    }
}
