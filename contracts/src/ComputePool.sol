// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AccessControl} from "@openzeppelin/contracts/access/AccessControl.sol";
import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {SafeERC20} from "@openzeppelin/contracts/token/ERC20/utils/SafeERC20.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {Pausable} from "@openzeppelin/contracts/utils/Pausable.sol";
import {ReentrancyGuard} from "@openzeppelin/contracts/utils/ReentrancyGuard.sol";

/// @title ComputePool: stake, accepted work, invalidation, slashing and rewards for one training run.
/// @notice One pool per training run. Nodes stake the pool token, validators record accepted work per
/// node under a unique work key (the submission hash), and may invalidate it within a window: a hard
/// invalidation removes the work, slashes a penalty from the node's stake to the treasury (never to
/// the slasher) and ejects the node; a soft invalidation only removes the work. Each accepted work unit
/// earns a reward that stays locked (and removable by invalidation) for a period, then is claimable.
/// Slashed stake is held in escrow for `appealWindow`: within it the node's operator (or the node key) may
/// appeal, and a validator other than the slasher resolves the appeal. Won: the stake returns to the node,
/// the work is accepted again with its reward reserved, and the ejection is undone if no other hard verdict
/// stands. Lost, or not appealed in time: the escrow goes to the treasury (never to any validator).
/// Every period (invalidation window, reward lock, unbonding) runs on the pool clock, `poolTime()`,
/// which stands still while the pool is paused: nobody can act during a pause, so a pause must not use
/// up a window (a verdict could no longer land, yet the reward would unlock).
contract ComputePool is AccessControl, Pausable, ReentrancyGuard, EIP712 {
    using SafeERC20 for IERC20;

    bytes32 public constant VALIDATOR_ROLE = keccak256("VALIDATOR_ROLE");
    bytes32 public constant TRAINER_ROLE = keccak256("TRAINER_ROLE");
    bytes32 public constant REGISTRATION_TYPEHASH =
        keccak256("Registration(address node,address operator,uint256 nonce,uint256 deadline)");

    enum NodeStatus {
        None, // never registered, or withdrawn after leaving
        Active,
        Leaving, // left voluntarily, stake unbonding
        Ejected // hard-invalidated, stake unbonding, key banned from this pool
    }

    enum WorkStatus {
        None,
        Accepted,
        Claimed,
        SoftInvalidated,
        HardInvalidated
    }

    /// What became of the stake one hard invalidation took (kept per work key).
    enum EscrowStatus {
        None, // no hard invalidation under this key
        Held, // in escrow; the node may appeal until `appealDeadline`
        Appealed, // appeal filed; a validator other than the slasher resolves it
        Upheld, // the appeal lost: paid to the treasury
        Overturned, // the appeal won: back in the node's stake, the work restored
        Released, // not appealed in time: paid to the treasury
        Lapsed // appealed, but no validator resolved it by `resolveDeadline`: the slash stands (treasury)
    }

    struct Node {
        address operator;
        NodeStatus status;
        uint64 unbondingEnd; // when the stake becomes withdrawable (Leaving or Ejected)
        uint256 stake;
        uint256 nonce; // registration nonce: each signature registers once
        uint256 acceptedUnits; // currently accepted (not invalidated) work units
    }

    // Packed: node, status, recordedAt and units share one slot, so recording work writes two slots.
    // A key invalidated before it was ever recorded keeps units == 0 and reward == 0 (recorded work always
    // has units > 0) and recordedAt = the pool time of the invalidation.
    struct Work {
        address node;
        WorkStatus status;
        uint40 recordedAt;
        uint48 units;
        uint256 reward;
    }

    /// The slash of one hard invalidation, held until the appeal window closes or an appeal is resolved.
    struct Escrow {
        address slasher; // the validator that invalidated: it may never resolve the appeal
        EscrowStatus status;
        uint40 appealDeadline; // pool clock: an appeal must be filed before this moment
        uint40 resolveDeadline; // pool clock, once appealed: unresolved at this moment, the appeal lapses
        uint256 amount; // stake taken (may be 0: the node had none left; the verdict is still appealable)
    }

    /// Per node: hard verdicts that stand, and what an overturned ejection restores.
    struct Ejection {
        NodeStatus priorStatus; // status before the ejection; None when there is nothing to restore
        uint64 priorUnbondingEnd;
        uint32 standing; // hard invalidations of this node not overturned
    }

    IERC20 public immutable token;
    uint64 public immutable unbondingPeriod;
    uint64 public immutable invalidationWindow;
    uint64 public immutable rewardLockPeriod;
    uint64 public immutable appealWindow;
    /// The longest appeal window the constructor takes: 100 years, so pool time plus it fits the uint40 deadlines
    /// (2^40 s) for tens of thousands of years.
    uint64 public constant MAX_APPEAL_WINDOW = 100 * 365 days;

    address public treasury;
    uint256 public minStake;
    uint256 public rewardPerUnit;
    uint256 public slashPenalty;

    /// Reward tokens funded but not yet promised to any work.
    uint256 public rewardBudget;
    /// Reward tokens promised to accepted, unclaimed work.
    uint256 public rewardsReserved;
    /// Stake held for all nodes (so the pots never mix).
    uint256 public totalStake;
    /// Slashed stake held in escrow until its appeal window closes or its appeal is resolved.
    uint256 public totalEscrow;
    /// Accounts holding VALIDATOR_ROLE (a pool with one validator lets it re-check its own verdicts).
    uint256 public validatorCount;
    /// @notice libp2p multiaddrs new peers of this run bootstrap discovery from (set by the admin; untrusted
    /// hints for readers, who check every entry and every announcement they then receive).
    string[] private _bootstrapPeers;
    uint256 public constant MAX_BOOTSTRAP_PEERS = 16;
    uint256 public constant MAX_BOOTSTRAP_PEER_BYTES = 256;

    uint64 public policyVersion;
    bytes32 public policyManifestHash;

    // The pool clock (one slot): seconds spent in finished pauses, and when the current pause began.
    uint64 private _pausedTotal;
    uint64 private _pausedAt;

    mapping(address node => Node) private _nodes;
    mapping(bytes32 workKey => Work) private _work;
    mapping(bytes32 workKey => Escrow) private _escrows;
    mapping(address node => Ejection) private _ejections;

    // ---- events (OZ adds RoleGranted/RoleRevoked/RoleAdminChanged, Paused/Unpaused) ----
    event NodeRegistered(address indexed node, address indexed operator, uint256 stake, uint256 nonce);
    event StakeAdded(address indexed node, address indexed operator, uint256 amount, uint256 total);
    event LeaveStarted(address indexed node, address indexed operator, uint64 unbondingEnd);
    event StakeWithdrawn(address indexed node, address indexed operator, uint256 amount);
    event WorkRecorded(
        address indexed node, bytes32 indexed workKey, address indexed validator, uint48 units, uint256 reward
    );
    event WorkInvalidated(
        address indexed node,
        bytes32 indexed workKey,
        address indexed validator,
        bool hard,
        uint16 reasonCode,
        bytes32 evidenceHash
    );
    /// recordWorkBatch met a key already known, or an invalidation batch a key already invalidated (recorded, claimed or invalidated): `node` and `status` are
    /// what the pool holds for it. Nothing changed; a resent batch is harmless.
    event WorkSkipped(address indexed node, bytes32 indexed workKey, address indexed validator, WorkStatus status);
    event StakeSlashed(address indexed node, bytes32 indexed workKey, address indexed treasury, uint256 amount);
    event NodeEjected(address indexed node, bytes32 indexed workKey, uint64 unbondingEnd);
    /// The slash of `workKey` is held in escrow; the node may appeal until `appealDeadline` (pool clock).
    event SlashEscrowed(address indexed node, bytes32 indexed workKey, uint256 amount, uint64 appealDeadline);
    event AppealFiled(address indexed node, bytes32 indexed workKey, address indexed appellant);
    /// `upheld`: the hard verdict stands; else it is overturned. `evidenceHash`: the resolver's re-check record.
    event AppealResolved(
        address indexed node, bytes32 indexed workKey, address indexed validator, bool upheld, bytes32 evidenceHash
    );
    /// An escrow paid to the treasury (appeal lost, or none filed in time).
    event EscrowReleased(address indexed node, bytes32 indexed workKey, address indexed treasury, uint256 amount);
    /// An appeal no validator resolved by its deadline: the slash stands (the escrow is released to the treasury).
    event AppealLapsed(address indexed node, bytes32 indexed workKey, uint64 resolveDeadline);
    /// An overturned slash: `amount` back in the node's stake.
    event SlashReversed(address indexed node, bytes32 indexed workKey, uint256 amount, uint256 stake);
    /// Overturned work accepted again, its reward reserved.
    event WorkRestored(address indexed node, bytes32 indexed workKey, uint48 units, uint256 reward);
    /// The last standing hard verdict of an ejected node was overturned: its status before the ejection.
    event NodeReinstated(address indexed node, bytes32 indexed workKey, NodeStatus status, uint64 unbondingEnd);
    event RewardsClaimed(address indexed node, address indexed operator, uint256 amount, uint256 workCount);
    event RewardsFunded(address indexed from, uint256 amount, uint256 budget);
    event RewardsDefunded(address indexed to, uint256 amount, uint256 budget);
    event PolicyPublished(uint64 indexed version, bytes32 manifestHash, address indexed trainer);
    event TreasuryChanged(address treasury);
    event MinStakeChanged(uint256 minStake);
    event RewardPerUnitChanged(uint256 rewardPerUnit);
    event SlashPenaltyChanged(uint256 slashPenalty);
    event BootstrapPeersSet(uint256 count);

    // ---- errors ----
    error ZeroAddress();
    error BadParameters();
    error TreasuryIsValidator(address account);
    error StakeBelowMinimum(uint256 stake, uint256 minimum);
    error SignatureExpired(uint256 deadline);
    error InvalidNodeSignature(address node, address signer);
    error NodeAlreadyRegistered(address node);
    error NodeIsEjected(address node);
    error NodeNotActive(address node);
    error NotOperator(address node, address caller);
    error NotUnbonding(address node);
    error StillUnbonding(uint64 unbondingEnd);
    error NothingToWithdraw(address node);
    error ZeroUnits();
    error DuplicateWorkKey(bytes32 workKey);
    error UnknownWorkKey(bytes32 workKey);
    error WorkNotAccepted(bytes32 workKey, WorkStatus status);
    error InvalidationWindowClosed(bytes32 workKey, uint64 closedAt);
    error RewardLocked(bytes32 workKey, uint64 unlockAt);
    error WorkOfOtherNode(bytes32 workKey, address node);
    error InsufficientRewardBudget(uint256 needed, uint256 available);
    error PolicyVersionNotIncreasing(uint64 current, uint64 proposed);
    error ZeroManifestHash();
    error ZeroEvidenceHash();
    error NotSlashed(bytes32 workKey);
    error WrongEscrowStatus(bytes32 workKey, EscrowStatus status);
    error AppealWindowClosed(bytes32 workKey, uint64 closedAt);
    error AppealWindowOpen(bytes32 workKey, uint64 closesAt);
    error ResolverIsSlasher(bytes32 workKey, address validator);
    error AppealStillOpen(bytes32 workKey, uint64 resolveDeadline);
    error WorkCleared(bytes32 workKey);

    constructor(
        IERC20 token_,
        address admin,
        address treasury_,
        uint256 minStake_,
        uint64 unbondingPeriod_,
        uint64 invalidationWindow_,
        uint64 rewardLockPeriod_,
        uint256 rewardPerUnit_,
        uint256 slashPenalty_,
        uint64 appealWindow_
    ) EIP712("PrimeComputePool", "1") {
        if (address(token_) == address(0) || admin == address(0) || treasury_ == address(0)) revert ZeroAddress();
        // A reward must stay locked, and stake bonded, for as long as the work behind it can be invalidated:
        // otherwise a cheater claims or withdraws before the validator's verdict lands.
        if (minStake_ == 0 || rewardLockPeriod_ < invalidationWindow_ || unbondingPeriod_ < invalidationWindow_) {
            revert BadParameters();
        }
        // Appeal deadlines are stored as uint40 (pool time + appealWindow): a longer window would wrap them to the
        // past and close every appeal at once.
        if (appealWindow_ > MAX_APPEAL_WINDOW) revert BadParameters();
        token = token_;
        treasury = treasury_;
        minStake = minStake_;
        unbondingPeriod = unbondingPeriod_;
        invalidationWindow = invalidationWindow_;
        rewardLockPeriod = rewardLockPeriod_;
        appealWindow = appealWindow_;
        rewardPerUnit = rewardPerUnit_;
        slashPenalty = slashPenalty_;
        _grantRole(DEFAULT_ADMIN_ROLE, admin);
    }

    // ------------------------------------------------------------------ nodes

    /// @notice Register `node` under the caller (its operator) with `amount` stake. `signature` is the
    /// node key's EIP-712 signature over Registration(node, operator=msg.sender, nonce, deadline), so
    /// nobody can claim someone else's node key, and the pool (verifyingContract) and chain are bound.
    function register(address node, uint256 amount, uint256 deadline, bytes calldata signature)
        external
        whenNotPaused
        nonReentrant
    {
        if (node == address(0)) revert ZeroAddress();
        Node storage n = _nodes[node];
        if (n.status == NodeStatus.Ejected) revert NodeIsEjected(node);
        if (n.status != NodeStatus.None) revert NodeAlreadyRegistered(node);
        if (block.timestamp > deadline) revert SignatureExpired(deadline);
        if (amount < minStake) revert StakeBelowMinimum(amount, minStake);
        uint256 nonce = n.nonce;
        bytes32 digest =
            _hashTypedDataV4(keccak256(abi.encode(REGISTRATION_TYPEHASH, node, msg.sender, nonce, deadline)));
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecover(digest, signature);
        if (err != ECDSA.RecoverError.NoError || signer != node) revert InvalidNodeSignature(node, signer);

        n.operator = msg.sender;
        n.status = NodeStatus.Active;
        n.unbondingEnd = 0;
        n.stake = amount;
        n.nonce = nonce + 1;
        totalStake += amount;
        emit NodeRegistered(node, msg.sender, amount, nonce);
        token.safeTransferFrom(msg.sender, address(this), amount);
    }

    /// @notice Top up an active node's stake.
    function addStake(address node, uint256 amount) external whenNotPaused nonReentrant {
        Node storage n = _onlyOperator(node);
        if (n.status != NodeStatus.Active) revert NodeNotActive(node);
        if (amount == 0) revert BadParameters();
        n.stake += amount;
        totalStake += amount;
        emit StakeAdded(node, msg.sender, amount, n.stake);
        token.safeTransferFrom(msg.sender, address(this), amount);
    }

    /// @notice Leave voluntarily: the node stops taking work and its stake unbonds (still slashable).
    function leavePool(address node) external whenNotPaused nonReentrant {
        Node storage n = _onlyOperator(node);
        if (n.status != NodeStatus.Active) revert NodeNotActive(node);
        uint64 end = _now() + unbondingPeriod;
        n.status = NodeStatus.Leaving;
        n.unbondingEnd = end;
        emit LeaveStarted(node, msg.sender, end);
    }

    /// @notice Withdraw the remaining stake of a node that left or was ejected, once unbonding has ended.
    function withdraw(address node) external whenNotPaused nonReentrant {
        Node storage n = _onlyOperator(node);
        if (n.status != NodeStatus.Leaving && n.status != NodeStatus.Ejected) revert NotUnbonding(node);
        if (_now() < n.unbondingEnd) revert StillUnbonding(n.unbondingEnd);
        uint256 amount = n.stake;
        if (amount == 0) revert NothingToWithdraw(node);
        // Effects before the transfer: a token with receive hooks finds nothing left to take.
        n.stake = 0;
        totalStake -= amount;
        // The key may register again (with a fresh signature: the nonce moved on). The operator stays so it
        // can still claim rewards that unlock later.
        if (n.status == NodeStatus.Leaving) n.status = NodeStatus.None;
        // An ejected node that took its stake and went has nothing to be reinstated to; a later won appeal
        // still returns its escrow (withdrawable at once).
        else _ejections[node].priorStatus = NodeStatus.None;
        emit StakeWithdrawn(node, msg.sender, amount);
        token.safeTransfer(msg.sender, amount);
    }

    // ------------------------------------------------------------------ work

    /// @notice Record accepted work of `node` under `workKey` (the submission hash). Reserves its reward.
    /// Strict: a key already known (recorded, claimed or invalidated) reverts with `DuplicateWorkKey`.
    function recordWork(address node, bytes32 workKey, uint48 units)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        if (_work[workKey].status != WorkStatus.None) revert DuplicateWorkKey(workKey);
        _recordWork(node, workKey, units);
    }

    /// @notice recordWork for many submissions in one transaction, idempotent so that a chain reporter may
    /// resend a batch whose outcome it does not know: a key already known (recorded, claimed or invalidated,
    /// by this batch or before) is skipped with `WorkSkipped`. Any other failure (inactive node, zero units,
    /// budget) reverts the whole batch.
    function recordWorkBatch(address[] calldata nodes, bytes32[] calldata workKeys, uint48[] calldata units)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        if (nodes.length != workKeys.length || nodes.length != units.length || nodes.length == 0) {
            revert BadParameters();
        }
        for (uint256 i = 0; i < nodes.length; ++i) {
            bytes32 key = workKeys[i];
            Work storage w = _work[key];
            if (w.status != WorkStatus.None) {
                emit WorkSkipped(w.node, key, msg.sender, w.status);
                continue;
            }
            _recordWork(nodes[i], key, units[i]);
        }
    }

    /// @notice Hard invalidation of `node`'s submission `workKey`, with the hash of the validator's evidence.
    /// If the key was recorded (for `node`, inside its invalidation window) the work is removed and its reward
    /// returned to the budget; if it was never recorded (it failed its checks) the key is marked invalidated
    /// for `node`, so it can never be recorded or paid. Either way `slashPenalty` (at most the remaining
    /// stake) goes to the treasury, never to the slasher, and an active or leaving node is ejected (its stake
    /// starts unbonding; the key is banned from this pool). The penalty is held in escrow for `appealWindow`
    /// (see `appeal`), then goes to the treasury (`releaseEscrow`).
    function invalidateHard(address node, bytes32 workKey, uint16 reasonCode, bytes32 evidenceHash)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        _invalidateHard(node, workKey, reasonCode, evidenceHash);
    }

    /// @notice invalidateHard for many submissions in one transaction, each slashed and escrowed as alone;
    /// idempotent like `recordWorkBatch`: a key already hard-invalidated (by this batch or before) is skipped
    /// with `WorkSkipped`. Any other failure reverts the whole batch.
    function invalidateHardBatch(
        address[] calldata nodes,
        bytes32[] calldata workKeys,
        uint16[] calldata reasonCodes,
        bytes32[] calldata evidenceHashes
    ) external onlyRole(VALIDATOR_ROLE) whenNotPaused nonReentrant {
        uint256 count = nodes.length;
        if (count != workKeys.length || count != reasonCodes.length || count != evidenceHashes.length || count == 0) {
            revert BadParameters();
        }
        for (uint256 i = 0; i < count; ++i) {
            Work storage w = _work[workKeys[i]];
            if (w.status == WorkStatus.HardInvalidated) {
                emit WorkSkipped(w.node, workKeys[i], msg.sender, w.status);
                continue;
            }
            _invalidateHard(nodes[i], workKeys[i], reasonCodes[i], evidenceHashes[i]);
        }
    }

    function _invalidateHard(address node, bytes32 workKey, uint16 reasonCode, bytes32 evidenceHash) private {
        if (evidenceHash == bytes32(0)) revert ZeroEvidenceHash();
        _invalidate(node, workKey, WorkStatus.HardInvalidated);
        emit WorkInvalidated(node, workKey, msg.sender, true, reasonCode, evidenceHash);

        Node storage n = _nodes[node];
        Ejection storage j = _ejections[node];
        uint256 penalty = slashPenalty < n.stake ? slashPenalty : n.stake;
        n.stake -= penalty;
        totalStake -= penalty;
        totalEscrow += penalty;
        j.standing += 1;
        uint64 now_ = _now();
        if (n.status == NodeStatus.Active || n.status == NodeStatus.Leaving) {
            j.priorStatus = n.status;
            j.priorUnbondingEnd = n.unbondingEnd;
            uint64 end = now_ + unbondingPeriod;
            n.status = NodeStatus.Ejected;
            n.unbondingEnd = end;
            emit NodeEjected(node, workKey, end);
        }
        uint64 deadline = now_ + appealWindow;
        _escrows[workKey] = Escrow({
            slasher: msg.sender,
            status: EscrowStatus.Held,
            appealDeadline: uint40(deadline),
            resolveDeadline: 0,
            amount: penalty
        });
        if (penalty > 0) emit StakeSlashed(node, workKey, treasury, penalty);
        emit SlashEscrowed(node, workKey, penalty, deadline);
    }

    // ------------------------------------------------------------------ appeals

    /// @notice Appeal the hard invalidation of `workKey`, by its node's operator or the node key itself, while
    /// `poolTime() < appealDeadline`. The escrow then stays held until a validator other than the slasher
    /// resolves the appeal (`resolveAppeal`; the slasher itself when it is the pool's only validator), for at
    /// most `appealWindow` more: after `resolveDeadline` anyone may let the appeal lapse (`lapseAppeal`).
    function appeal(bytes32 workKey) external whenNotPaused nonReentrant {
        Escrow storage e = _escrows[workKey];
        EscrowStatus status = e.status;
        if (status == EscrowStatus.None) revert NotSlashed(workKey);
        address node = _work[workKey].node;
        if (msg.sender != node && msg.sender != _nodes[node].operator) revert NotOperator(node, msg.sender);
        if (status != EscrowStatus.Held) revert WrongEscrowStatus(workKey, status);
        uint64 closedAt = uint64(e.appealDeadline);
        if (_now() >= closedAt) revert AppealWindowClosed(workKey, closedAt);
        e.status = EscrowStatus.Appealed;
        e.resolveDeadline = uint40(_now() + appealWindow);
        emit AppealFiled(node, workKey, msg.sender);
    }

    /// @notice Resolve the appeal of `workKey` (any validator but the slasher), with the hash of the re-check's
    /// record. `upheld`: the verdict stands and the escrow goes to the treasury. Otherwise the escrow returns to
    /// the node's stake, the work is accepted again with its reward reserved from the budget (recorded work keeps
    /// its units, reward and recording time; a key never recorded is recorded now with `units`), it can never be
    /// invalidated again, and an ejected node whose hard verdicts are all overturned gets its old status back
    /// (unless it has withdrawn its stake since).
    function resolveAppeal(bytes32 workKey, bool upheld, uint48 units, bytes32 evidenceHash)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        if (evidenceHash == bytes32(0)) revert ZeroEvidenceHash();
        Escrow storage e = _escrows[workKey];
        if (e.status != EscrowStatus.Appealed) revert WrongEscrowStatus(workKey, e.status);
        // A second opinion where there is one; a pool with a single validator has only the slasher's re-check.
        if (e.slasher == msg.sender && validatorCount > 1) revert ResolverIsSlasher(workKey, msg.sender);
        Work storage w = _work[workKey];
        address node = w.node;
        uint256 amount = e.amount;
        emit AppealResolved(node, workKey, msg.sender, upheld, evidenceHash);
        if (upheld) {
            e.status = EscrowStatus.Upheld;
            _payTreasury(node, workKey, amount);
            return;
        }
        e.status = EscrowStatus.Overturned;
        totalEscrow -= amount;
        Node storage n = _nodes[node];
        n.stake += amount;
        totalStake += amount;
        emit SlashReversed(node, workKey, amount, n.stake);

        uint256 reward = w.reward;
        if (w.units == 0) {
            // Rejected before it was ever recorded: record it now, with the units the resolver measured.
            if (units == 0) revert ZeroUnits();
            reward = uint256(units) * rewardPerUnit;
            w.units = units;
            w.recordedAt = uint40(_now());
            w.reward = reward;
        }
        uint256 budget = rewardBudget;
        if (reward > budget) revert InsufficientRewardBudget(reward, budget);
        rewardBudget = budget - reward;
        rewardsReserved += reward;
        w.status = WorkStatus.Accepted;
        n.acceptedUnits += w.units;
        emit WorkRestored(node, workKey, w.units, reward);

        Ejection storage j = _ejections[node];
        j.standing -= 1;
        if (j.standing == 0 && n.status == NodeStatus.Ejected && j.priorStatus != NodeStatus.None) {
            n.status = j.priorStatus;
            n.unbondingEnd = j.priorUnbondingEnd;
            j.priorStatus = NodeStatus.None;
            emit NodeReinstated(node, workKey, n.status, n.unbondingEnd);
        }
    }

    /// @notice Let an appeal that no validator resolved by its `resolveDeadline` lapse (anyone may call): the
    /// slash stands and the escrow goes to the treasury. Why not the stake back: a validator can resolve only
    /// an appeal the node sends it (`prime-node appeal`), and any validator, the slasher included in a
    /// one-validator pool, can; so an appeal left unresolved for a whole window is one its appellant did not
    /// carry through (or that every validator of the pool could not check, an outage the pool's operators
    /// answer for). Returning the stake would make "file on chain, never send it" a free exit from every slash.
    function lapseAppeal(bytes32 workKey) external whenNotPaused nonReentrant {
        Escrow storage e = _escrows[workKey];
        if (e.status != EscrowStatus.Appealed) revert WrongEscrowStatus(workKey, e.status);
        uint64 deadline = uint64(e.resolveDeadline);
        if (_now() < deadline) revert AppealStillOpen(workKey, deadline);
        e.status = EscrowStatus.Lapsed;
        address node = _work[workKey].node;
        emit AppealLapsed(node, workKey, deadline);
        _payTreasury(node, workKey, e.amount);
    }

    /// @notice Pay the escrow of `workKey` to the treasury once its appeal window has closed unappealed
    /// (anyone may call).
    function releaseEscrow(bytes32 workKey) external whenNotPaused nonReentrant {
        Escrow storage e = _escrows[workKey];
        if (e.status != EscrowStatus.Held) revert WrongEscrowStatus(workKey, e.status);
        uint64 closesAt = uint64(e.appealDeadline);
        if (_now() < closesAt) revert AppealWindowOpen(workKey, closesAt);
        e.status = EscrowStatus.Released;
        _payTreasury(_work[workKey].node, workKey, e.amount);
    }

    /// @notice Soft invalidation of `node`'s submission `workKey` (honest but unusable: stale, not assigned
    /// here, a validator-side failure). Recorded work is removed with its reward; a key never recorded is
    /// marked consumed so it is never paid. No slash.
    function invalidateSoft(address node, bytes32 workKey, uint16 reasonCode)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        _invalidate(node, workKey, WorkStatus.SoftInvalidated);
        emit WorkInvalidated(node, workKey, msg.sender, false, reasonCode, bytes32(0));
    }


    /// @notice invalidateSoft for many submissions in one transaction (no stake moves, so a chain reporter
    /// sends them together), idempotent like `recordWorkBatch`: a key already invalidated (hard or soft, by
    /// this batch or before) is skipped with `WorkSkipped`. Any other failure (another node's work, work
    /// already claimed, the invalidation window closed) reverts the whole batch.
    function invalidateSoftBatch(address[] calldata nodes, bytes32[] calldata workKeys, uint16[] calldata reasonCodes)
        external
        onlyRole(VALIDATOR_ROLE)
        whenNotPaused
        nonReentrant
    {
        if (nodes.length != workKeys.length || nodes.length != reasonCodes.length || nodes.length == 0) {
            revert BadParameters();
        }
        for (uint256 i = 0; i < nodes.length; ++i) {
            bytes32 key = workKeys[i];
            Work storage w = _work[key];
            if (w.status == WorkStatus.SoftInvalidated || w.status == WorkStatus.HardInvalidated) {
                emit WorkSkipped(w.node, key, msg.sender, w.status);
                continue;
            }
            _invalidate(nodes[i], key, WorkStatus.SoftInvalidated);
            emit WorkInvalidated(nodes[i], key, msg.sender, false, reasonCodes[i], bytes32(0));
        }
    }

    /// @notice Claim the unlocked rewards of `node`'s accepted work `workKeys`; paid to its operator. A reward
    /// unlocks at `recordedAt + rewardLockPeriod` (pool clock), the moment its invalidation window has closed
    /// at the latest (the constructor enforces `rewardLockPeriod >= invalidationWindow`).
    function claimRewards(address node, bytes32[] calldata workKeys) external whenNotPaused nonReentrant {
        _onlyOperator(node);
        uint64 now_ = _now();
        uint256 total;
        for (uint256 i = 0; i < workKeys.length; ++i) {
            bytes32 key = workKeys[i];
            Work storage w = _work[key];
            if (w.status == WorkStatus.None) revert UnknownWorkKey(key);
            if (w.node != node) revert WorkOfOtherNode(key, w.node);
            if (w.status != WorkStatus.Accepted) revert WorkNotAccepted(key, w.status);
            uint64 unlockAt = uint64(w.recordedAt) + rewardLockPeriod;
            if (now_ < unlockAt) revert RewardLocked(key, unlockAt);
            w.status = WorkStatus.Claimed;
            total += w.reward;
        }
        if (total == 0) revert BadParameters();
        rewardsReserved -= total;
        emit RewardsClaimed(node, msg.sender, total, workKeys.length);
        token.safeTransfer(msg.sender, total);
    }

    // ------------------------------------------------------------------ trainer

    /// @notice Announce policy `version` (the trainer step) and the hash of its signed SHARDCAST manifest.
    /// Versions only increase; the first may be any number (0 included). A zero hash is refused, so a
    /// non-zero `policyManifestHash` always means "something was published" and versions cannot go back.
    function publishPolicy(uint64 version, bytes32 manifestHash) external onlyRole(TRAINER_ROLE) whenNotPaused {
        if (manifestHash == bytes32(0)) revert ZeroManifestHash();
        if (policyManifestHash != bytes32(0) && version <= policyVersion) {
            revert PolicyVersionNotIncreasing(policyVersion, version);
        }
        policyVersion = version;
        policyManifestHash = manifestHash;
        emit PolicyPublished(version, manifestHash, msg.sender);
    }

    // ------------------------------------------------------------------ rewards budget

    /// @notice Add reward tokens to the budget (anyone may fund a run).
    function fundRewards(uint256 amount) external whenNotPaused nonReentrant {
        if (amount == 0) revert BadParameters();
        rewardBudget += amount;
        emit RewardsFunded(msg.sender, amount, rewardBudget);
        token.safeTransferFrom(msg.sender, address(this), amount);
    }

    /// @notice Take back budget not yet promised to any work (e.g. at the end of a run).
    function defundRewards(address to, uint256 amount) external onlyRole(DEFAULT_ADMIN_ROLE) nonReentrant {
        if (to == address(0)) revert ZeroAddress();
        if (amount == 0 || amount > rewardBudget) revert InsufficientRewardBudget(amount, rewardBudget);
        rewardBudget -= amount;
        emit RewardsDefunded(to, amount, rewardBudget);
        token.safeTransfer(to, amount);
    }

    // ------------------------------------------------------------------ admin

    function setTreasury(address treasury_) external onlyRole(DEFAULT_ADMIN_ROLE) {
        if (treasury_ == address(0)) revert ZeroAddress();
        if (hasRole(VALIDATOR_ROLE, treasury_)) revert TreasuryIsValidator(treasury_);
        treasury = treasury_;
        emit TreasuryChanged(treasury_);
    }

    function setMinStake(uint256 minStake_) external onlyRole(DEFAULT_ADMIN_ROLE) {
        if (minStake_ == 0) revert BadParameters();
        minStake = minStake_;
        emit MinStakeChanged(minStake_);
    }

    function setRewardPerUnit(uint256 rewardPerUnit_) external onlyRole(DEFAULT_ADMIN_ROLE) {
        rewardPerUnit = rewardPerUnit_;
        emit RewardPerUnitChanged(rewardPerUnit_);
    }

    function setSlashPenalty(uint256 slashPenalty_) external onlyRole(DEFAULT_ADMIN_ROLE) {
        slashPenalty = slashPenalty_;
        emit SlashPenaltyChanged(slashPenalty_);
    }

    /// @notice Replace the run's discovery bootstrap list (at most 16 multiaddrs of at most 256 bytes each).
    function setBootstrapPeers(string[] calldata peers) external onlyRole(DEFAULT_ADMIN_ROLE) {
        if (peers.length > MAX_BOOTSTRAP_PEERS) revert BadParameters();
        delete _bootstrapPeers;
        for (uint256 i = 0; i < peers.length; i++) {
            uint256 size = bytes(peers[i]).length;
            if (size == 0 || size > MAX_BOOTSTRAP_PEER_BYTES) revert BadParameters();
            _bootstrapPeers.push(peers[i]);
        }
        emit BootstrapPeersSet(peers.length);
    }

    function bootstrapPeers() external view returns (string[] memory) {
        return _bootstrapPeers;
    }

    /// @notice Stop every state change except admin configuration, and stop the pool clock.
    function pause() external onlyRole(DEFAULT_ADMIN_ROLE) {
        _pause();
        _pausedAt = uint64(block.timestamp);
    }

    /// @notice Resume; the pool clock goes on from where it stood when the pool was paused.
    function unpause() external onlyRole(DEFAULT_ADMIN_ROLE) {
        _unpause();
        _pausedTotal += uint64(block.timestamp) - _pausedAt;
    }

    // ------------------------------------------------------------------ views

    function getNode(address node) external view returns (Node memory) {
        return _nodes[node];
    }

    function getWork(bytes32 workKey) external view returns (Work memory) {
        return _work[workKey];
    }

    function getEscrow(bytes32 workKey) external view returns (Escrow memory) {
        return _escrows[workKey];
    }

    function getEjection(address node) external view returns (Ejection memory) {
        return _ejections[node];
    }

    function isActive(address node) external view returns (bool) {
        return _nodes[node].status == NodeStatus.Active;
    }

    function domainSeparator() external view returns (bytes32) {
        return _domainSeparatorV4();
    }

    /// @notice The pool clock: `block.timestamp` less every second spent paused (standing still during a
    /// pause). `recordedAt`, `unbondingEnd` and the times in `RewardLocked`, `InvalidationWindowClosed`
    /// and `StillUnbonding` are on this clock.
    function poolTime() external view returns (uint64) {
        return paused() ? _pausedAt - _pausedTotal : _now();
    }

    // ------------------------------------------------------------------ internals

    /// A validator may never receive slashed stake, so the treasury can never hold the validator role.
    function _grantRole(bytes32 role, address account) internal override returns (bool) {
        if (role == VALIDATOR_ROLE && account == treasury) revert TreasuryIsValidator(account);
        bool granted = super._grantRole(role, account);
        if (granted && role == VALIDATOR_ROLE) validatorCount += 1;
        return granted;
    }

    function _revokeRole(bytes32 role, address account) internal override returns (bool) {
        bool revoked = super._revokeRole(role, account);
        if (revoked && role == VALIDATOR_ROLE) validatorCount -= 1;
        return revoked;
    }

    /// The pool clock while not paused (every caller is `whenNotPaused`).
    function _now() private view returns (uint64) {
        return uint64(block.timestamp) - _pausedTotal;
    }

    function _onlyOperator(address node) private view returns (Node storage n) {
        n = _nodes[node];
        if (n.operator != msg.sender) revert NotOperator(node, msg.sender);
    }

    /// Pay an escrow to the treasury (checks and effects done by the caller).
    function _payTreasury(address node, bytes32 workKey, uint256 amount) private {
        totalEscrow -= amount;
        address to = treasury;
        emit EscrowReleased(node, workKey, to, amount);
        if (amount > 0) token.safeTransfer(to, amount);
    }

    /// Record `node`'s work under `workKey`, which the caller checked is unknown.
    function _recordWork(address node, bytes32 workKey, uint48 units) private {
        Node storage n = _nodes[node];
        if (n.status != NodeStatus.Active) revert NodeNotActive(node);
        if (units == 0) revert ZeroUnits();
        uint256 reward = uint256(units) * rewardPerUnit;
        uint256 budget = rewardBudget;
        if (reward > budget) revert InsufficientRewardBudget(reward, budget);
        rewardBudget = budget - reward;
        rewardsReserved += reward;
        n.acceptedUnits += units;
        _work[workKey] = Work({
            node: node,
            status: WorkStatus.Accepted,
            recordedAt: uint40(_now()),
            units: units,
            reward: reward
        });
        emit WorkRecorded(node, workKey, msg.sender, units, reward);
    }

    /// Mark `workKey` invalidated (`status`) for `node`: recorded work inside its window is removed with its
    /// reward; an unknown key is consumed. Anything else (another node's key, a key already claimed or
    /// invalidated, a closed window) reverts.
    function _invalidate(address node, bytes32 workKey, WorkStatus status) private {
        if (node == address(0)) revert ZeroAddress();
        Work storage w = _work[workKey];
        WorkStatus current = w.status;
        if (current == WorkStatus.None) {
            // Failed before it was ever recorded: the key is used up for good (units and reward stay 0).
            _work[workKey] = Work({node: node, status: status, recordedAt: uint40(_now()), units: 0, reward: 0});
            return;
        }
        if (w.node != node) revert WorkOfOtherNode(workKey, w.node);
        if (current != WorkStatus.Accepted) revert WorkNotAccepted(workKey, current);
        // Work an appeal cleared was checked twice; it is not taken away again.
        if (_escrows[workKey].status == EscrowStatus.Overturned) revert WorkCleared(workKey);
        // Open while now < recordedAt + window; a reward unlocks at recordedAt + lock >= that moment, so no
        // second exists in which work can be both invalidated and paid.
        uint64 closedAt = uint64(w.recordedAt) + invalidationWindow;
        if (_now() >= closedAt) revert InvalidationWindowClosed(workKey, closedAt);
        w.status = status;
        uint256 reward = w.reward;
        rewardsReserved -= reward;
        rewardBudget += reward; // the reward was never earned: back to the run's budget
        _nodes[node].acceptedUnits -= w.units;
    }
}
