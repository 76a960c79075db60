"""The compiled inner loop of FastSA (numba, cached on disk).

State of one annealing run (all numpy arrays, so a run can be stopped and resumed between
chunks of iterations without changing its result):

* ``slot_node[t]``: the node computed in slot t of the fixed-length sequence, or -1 (a no-op);
* ``nxt[t]`` / ``prv[t]``: the next / previous slot computing the same node (a sorted linked
  list of a node's copies), ``head[v]`` its first copy, ``ncopy[v]`` how many there are;
* ``slot_end[t]``: the last slot of the life interval of the value computed at t: the last
  reader that uses this copy (a reader uses the newest copy computed before it), the end of the
  sequence for the last copy of an output, or t itself when nobody reads it;
* ``tr`` / ``lz``: a range-add / range-max segment tree over the slots holding the memory in use
  in each slot (the sum of the sizes of the values whose interval covers it). The peak is the
  root, ``fixed_memory`` aside.

Memory in a compute slot is what the simulator in :mod:`tf_remat.plan` measures right after
that compute (inputs, output and everything else resident), and no-op slots never hold more than
the compute slot before them, so ``fixed + tr[1]`` equals the simulated peak of the sequence.

A state is valid exactly when every node has a copy and, for every edge ``u -> w``,
``head[u] < head[w]``: any later copy of w then finds a copy of u before it. The mutations keep
that invariant with O(degree) checks; each updates the intervals it touches with O(log T) tree
operations.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Indices into the float parameter vector ``fpar``.
F_BUDGET, F_FIXED, F_T0, F_T1, F_PENALTY, F_ELU_SCALE, F_P_ADD, F_P_REMOVE, F_TOTAL_IT = range(9)
# Indices into the int parameter vector ``ipar``.
I_T, I_SIZE, I_FIXED_ORDER, I_ELU, I_MAX_DIST, I_SNAP_GAP = range(6)
# Indices into the float run-state vector ``fst``.
S_COST, S_OBJ, S_BEST_FEAS_COST, S_BEST_FEAS_PEAK, S_BEST_ANY_OBJ, S_BEST_ANY_COST, \
    S_BEST_ANY_PEAK = range(7)
# Indices into the int run-state vector ``ist``.
C_ITER, C_PROPOSED, C_APPLIED, C_ACCEPTED, C_MULTI, C_SNAP_FEAS_IT, C_SNAP_ANY_IT, \
    C_HAVE_FEAS, C_HAVE_ANY, C_PENDING_FEAS, C_PENDING_ANY = range(11)


# --------------------------------------------------------------------- random numbers
@njit(cache=True)
def _next(rng):
    """xorshift64*; ``rng`` is a uint64[1] array, so the stream survives between calls."""
    x = rng[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    rng[0] = x
    return x * np.uint64(2685821657736338717)


@njit(cache=True)
def _randint(rng, k):
    return np.int64((_next(rng) >> np.uint64(11)) % np.uint64(k))


@njit(cache=True)
def _uniform(rng):
    return np.float64(_next(rng) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


# --------------------------------------------------------------------- segment tree
@njit(cache=True)
def _pull(tr, lz, p):
    while p >= 1:
        a = tr[2 * p]
        b = tr[2 * p + 1]
        tr[p] = (a if a > b else b) + lz[p]
        p >>= 1


@njit(cache=True)
def seg_add(tr, lz, size, l, r, val):
    """Add ``val`` to slots ``l..r`` (inclusive) and refresh the maxima above them."""
    if l > r or val == 0:
        return
    lo = l + size
    hi = r + size + 1
    a = lo
    b = hi
    while a < b:
        if a & 1:
            tr[a] += val
            lz[a] += val
            a += 1
        if b & 1:
            b -= 1
            tr[b] += val
            lz[b] += val
        a >>= 1
        b >>= 1
    lo >>= 1
    hi = (hi - 1) >> 1
    while lo >= 1:
        x = tr[2 * lo]
        y = tr[2 * lo + 1]
        tr[lo] = (x if x > y else y) + lz[lo]
        if hi != lo:
            x = tr[2 * hi]
            y = tr[2 * hi + 1]
            tr[hi] = (x if x > y else y) + lz[hi]
        lo >>= 1
        hi >>= 1


@njit(cache=True)
def seg_point(tr, lz, size, t):
    """Memory in slot t (for checks)."""
    p = t + size
    s = tr[p]
    p >>= 1
    while p >= 1:
        s += lz[p]
        p >>= 1
    return s


# --------------------------------------------------------------------- intervals
@njit(cache=True)
def _scan_end(v, t, nx, T, succ_ptr, succ_idx, head, nxt, is_out):
    """Last slot of the value computed at t (next copy of v at ``nx``, -1 if none)."""
    if nx == -1:
        if is_out[v]:
            return T - 1
        lim = T
    else:
        lim = nx
    e = t
    for k in range(succ_ptr[v], succ_ptr[v + 1]):
        s = head[succ_idx[k]]
        while s != -1 and s < lim:
            if s > e:
                e = s
            s = nxt[s]
    return e


@njit(cache=True)
def _latest_before(u, t, head, nxt):
    p = -1
    s = head[u]
    while s != -1 and s < t:
        p = s
        s = nxt[s]
    return p


@njit(cache=True)
def _set_end(c, m, new_end, slot_end, tr, lz, size):
    old = slot_end[c]
    if new_end > old:
        seg_add(tr, lz, size, old + 1, new_end, m)
    elif new_end < old:
        seg_add(tr, lz, size, new_end + 1, old, -m)
    slot_end[c] = new_end


@njit(cache=True)
def _multi_add(v, multi, mpos, ist):
    if mpos[v] < 0:
        k = ist[C_MULTI]
        multi[k] = v
        mpos[v] = k
        ist[C_MULTI] = k + 1


@njit(cache=True)
def _multi_drop(v, multi, mpos, ist):
    k = mpos[v]
    if k >= 0:
        last = ist[C_MULTI] - 1
        w = multi[last]
        multi[k] = w
        mpos[w] = k
        mpos[v] = -1
        ist[C_MULTI] = last


# --------------------------------------------------------------------- mutations
@njit(cache=True)
def apply_add(v, t, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, cost, is_out,
              slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos, tr, lz, fst, ist):
    """Compute v in the empty slot t (every input of v must have a copy before t)."""
    p = _latest_before(v, t, head, nxt)
    n_ = head[v] if p == -1 else nxt[p]
    prv[t] = p
    nxt[t] = n_
    if p == -1:
        head[v] = t
    else:
        nxt[p] = t
    if n_ != -1:
        prv[n_] = t
    slot_node[t] = v
    ncopy[v] += 1
    if ncopy[v] == 2:
        _multi_add(v, multi, mpos, ist)
    fst[S_COST] += cost[v]
    for k in range(pred_ptr[v], pred_ptr[v + 1]):
        u = pred_idx[k]
        c = _latest_before(u, t, head, nxt)
        if slot_end[c] < t:
            _set_end(c, mem[u], t, slot_end, tr, lz, size)
    e = _scan_end(v, t, n_, T, succ_ptr, succ_idx, head, nxt, is_out)
    slot_end[t] = e
    seg_add(tr, lz, size, t, e, mem[v])
    if extra[v] != 0:
        seg_add(tr, lz, size, t, t, extra[v])
    if p != -1:
        _set_end(p, mem[v], _scan_end(v, p, t, T, succ_ptr, succ_idx, head, nxt, is_out),
                 slot_end, tr, lz, size)


@njit(cache=True)
def apply_remove(t, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, cost, is_out,
                 slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos, tr, lz, fst, ist):
    """Drop the copy in slot t (the readers it served must find an earlier copy)."""
    v = slot_node[t]
    p = prv[t]
    n_ = nxt[t]
    seg_add(tr, lz, size, t, slot_end[t], -mem[v])
    if extra[v] != 0:
        seg_add(tr, lz, size, t, t, -extra[v])
    if p == -1:
        head[v] = n_
    else:
        nxt[p] = n_
    if n_ != -1:
        prv[n_] = p
    slot_node[t] = -1
    nxt[t] = -1
    prv[t] = -1
    ncopy[v] -= 1
    if ncopy[v] == 1:
        _multi_drop(v, multi, mpos, ist)
    fst[S_COST] -= cost[v]
    if p != -1:
        _set_end(p, mem[v], _scan_end(v, p, n_, T, succ_ptr, succ_idx, head, nxt, is_out),
                 slot_end, tr, lz, size)
    for k in range(pred_ptr[v], pred_ptr[v + 1]):
        u = pred_idx[k]
        c = _latest_before(u, t, head, nxt)
        if slot_end[c] == t:
            _set_end(c, mem[u], _scan_end(u, c, nxt[c], T, succ_ptr, succ_idx, head, nxt,
                                          is_out), slot_end, tr, lz, size)


# --------------------------------------------------------------------- helpers for proposals
@njit(cache=True)
def _nth_copy(v, k, head, nxt):
    s = head[v]
    while k > 0:
        s = nxt[s]
        k -= 1
    return s


@njit(cache=True)
def _inputs_ready_after(v, pred_ptr, pred_idx, head):
    """The largest head among v's inputs (v may be computed only after it), -1 if none."""
    L = -1
    for k in range(pred_ptr[v], pred_ptr[v + 1]):
        h = head[pred_idx[k]]
        if h > L:
            L = h
    return L


@njit(cache=True)
def _first_reader(v, T, succ_ptr, succ_idx, head):
    """The smallest head among v's readers (T if none)."""
    H = T
    for k in range(succ_ptr[v], succ_ptr[v + 1]):
        h = head[succ_idx[k]]
        if h < H:
            H = h
    return H


@njit(cache=True)
def _distance(rng, max_dist):
    """A log-uniform distance in 1..max_dist (short moves often, long ones sometimes)."""
    return np.int64(np.exp(_uniform(rng) * np.log(max_dist + 1.0)))


@njit(cache=True)
def _find_empty(slot_node, t, lo, hi, step):
    """The empty slot nearest to t walking by ``step`` (+1/-1), within lo..hi, at most 8 tries."""
    for _ in range(8):
        if t < lo or t > hi:
            return -1
        if slot_node[t] == -1:
            return t
        t += step
    return -1


@njit(cache=True)
def _objective(M, C, B, penalty, elu, elu_scale):
    if M > B:
        g = B + penalty * (M - B)
    elif elu:
        s = elu_scale * B
        g = B + s * (np.exp((M - B) / s) - 1.0)
    else:
        g = B
    return g * C


# --------------------------------------------------------------------- the annealing loop
@njit(cache=True)
def anneal(n_iter, fpar, ipar, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, cost, is_out,
           recomp, slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos, tr, lz, rng, fst, ist,
           best_feas, best_any):
    """Run ``n_iter`` more proposals of the annealing whose progress is in ``ist``/``fst``.

    Temperature falls geometrically from ``fpar[F_T0]`` to ``fpar[F_T1]`` over
    ``fpar[F_TOTAL_IT]`` proposals, as a function of the global proposal index, so chunking the
    run does not change it. The best state within budget (least cost) and the best state by
    objective are copied into ``best_feas`` / ``best_any`` (at most once per ``I_SNAP_GAP``
    proposals; a better state found sooner is copied at the next chance).
    """
    n = head.shape[0]
    T = ipar[I_T]
    size = ipar[I_SIZE]
    fixed_order = ipar[I_FIXED_ORDER] != 0
    elu = ipar[I_ELU] != 0
    max_dist = ipar[I_MAX_DIST]
    snap_gap = ipar[I_SNAP_GAP]
    B = fpar[F_BUDGET]
    fixed = fpar[F_FIXED]
    T0 = fpar[F_T0]
    log_ratio = np.log(fpar[F_T1] / T0)
    total = fpar[F_TOTAL_IT]
    penalty = fpar[F_PENALTY]
    elu_scale = fpar[F_ELU_SCALE]
    p_add = fpar[F_P_ADD]
    p_rem = p_add + fpar[F_P_REMOVE]
    cur = fst[S_OBJ]
    temp = T0
    it0 = ist[C_ITER]
    for i in range(n_iter):
        it = it0 + i
        if (i & 255) == 0:
            temp = T0 * np.exp(log_ratio * min(1.0, it / total))
        r = _uniform(rng)
        kind = 0
        a = -1      # slot to add at
        rm = -1     # slot to remove
        v = -1
        if r < p_add:
            # add a copy of an input v of a computation w, shortly before it
            w = _randint(rng, n)
            deg = pred_ptr[w + 1] - pred_ptr[w]
            if deg == 0:
                continue
            v = pred_idx[pred_ptr[w] + _randint(rng, deg)]
            if recomp[v] == 0:
                continue
            s = _nth_copy(w, _randint(rng, ncopy[w]), head, nxt)
            L = _inputs_ready_after(v, pred_ptr, pred_idx, head)
            if fixed_order and head[v] > L:
                L = head[v]
            t = s - _distance(rng, max_dist)
            if t <= L:
                t = L + 1
            if t >= s:
                continue
            a = _find_empty(slot_node, t, L + 1, s - 1, -1 if _uniform(rng) < 0.5 else 1)
            if a == -1:
                continue
            if _latest_before(v, s, head, nxt) > a:
                continue  # a newer copy already serves w
            kind = 1
        elif r < p_rem:
            nm = ist[C_MULTI]
            if nm == 0:
                continue
            v = multi[_randint(rng, nm)]
            t = _nth_copy(v, _randint(rng, ncopy[v]), head, nxt)
            if t == head[v]:
                if fixed_order:
                    continue
                if nxt[t] >= _first_reader(v, T, succ_ptr, succ_idx, head):
                    continue
            rm = t
            kind = 2
        else:
            v = _randint(rng, n)
            t = _nth_copy(v, _randint(rng, ncopy[v]), head, nxt)
            L = _inputs_ready_after(v, pred_ptr, pred_idx, head)
            U = T - 1
            if t == head[v]:
                if fixed_order:
                    continue
                t2 = nxt[t]
                H = _first_reader(v, T, succ_ptr, succ_idx, head)
                if t2 == -1 or t2 >= H:
                    U = H - 1
            elif fixed_order:
                if head[v] > L:
                    L = head[v]
            d = _distance(rng, max_dist)
            if _uniform(rng) < 0.5:
                d = -d
            t2 = t + d
            if t2 <= L:
                t2 = L + 1
            if t2 > U:
                t2 = U
            if t2 == t:
                continue
            a = _find_empty(slot_node, t2, L + 1, U, 1 if d < 0 else -1)
            if a == -1:
                continue
            rm = t
            kind = 3
        ist[C_PROPOSED] += 1
        # apply
        if kind == 1 or kind == 3:
            apply_add(v, a, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, cost,
                      is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos, tr, lz,
                      fst, ist)
        if kind == 2 or kind == 3:
            apply_remove(rm, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, cost,
                         is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos, tr, lz,
                         fst, ist)
        ist[C_APPLIED] += 1
        M = fixed + tr[1]
        C = fst[S_COST]
        new = _objective(M, C, B, penalty, elu, elu_scale)
        d_rel = (new - cur) / cur
        if d_rel <= 0.0 or _uniform(rng) < np.exp(-d_rel / temp):
            cur = new
            ist[C_ACCEPTED] += 1
        else:
            # undo: the state is a function of the set of copies, so the inverse mutation
            # restores it exactly
            if kind == 1:
                apply_remove(a, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra,
                             cost, is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi,
                             mpos, tr, lz, fst, ist)
            elif kind == 2:
                apply_add(v, rm, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra,
                          cost, is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos,
                          tr, lz, fst, ist)
            else:
                apply_add(v, rm, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra,
                          cost, is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi, mpos,
                          tr, lz, fst, ist)
                apply_remove(a, T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra,
                             cost, is_out, slot_node, slot_end, nxt, prv, head, ncopy, multi,
                             mpos, tr, lz, fst, ist)
            continue
        _track_best(it, M, C, cur, B, snap_gap, slot_node, best_feas, best_any, fst, ist)
    ist[C_ITER] = it0 + n_iter
    fst[S_OBJ] = cur
    # a better state seen since the last copy but not copied yet: the current one is at least
    # as good as the stored one when it is pending, so copy it now
    M = fixed + tr[1]
    C = fst[S_COST]
    if ist[C_PENDING_FEAS] != 0 and M <= B and C <= fst[S_BEST_FEAS_COST]:
        best_feas[:] = slot_node
        fst[S_BEST_FEAS_COST] = C
        fst[S_BEST_FEAS_PEAK] = M
        ist[C_PENDING_FEAS] = 0
    if ist[C_PENDING_ANY] != 0 and cur <= fst[S_BEST_ANY_OBJ]:
        best_any[:] = slot_node
        fst[S_BEST_ANY_OBJ] = cur
        fst[S_BEST_ANY_COST] = C
        fst[S_BEST_ANY_PEAK] = M
        ist[C_PENDING_ANY] = 0
    return ist[C_ITER]


@njit(cache=True)
def _track_best(it, M, C, cur, B, snap_gap, slot_node, best_feas, best_any, fst, ist):
    if M <= B and (ist[C_HAVE_FEAS] == 0 or C < fst[S_BEST_FEAS_COST] - 1e-12 * C):
        if ist[C_HAVE_FEAS] == 0 or it - ist[C_SNAP_FEAS_IT] >= snap_gap:
            best_feas[:] = slot_node
            fst[S_BEST_FEAS_COST] = C
            fst[S_BEST_FEAS_PEAK] = M
            ist[C_SNAP_FEAS_IT] = it
            ist[C_HAVE_FEAS] = 1
            ist[C_PENDING_FEAS] = 0
        else:
            ist[C_PENDING_FEAS] = 1
    elif ist[C_PENDING_FEAS] != 0 and M <= B and C <= fst[S_BEST_FEAS_COST] \
            and it - ist[C_SNAP_FEAS_IT] >= snap_gap:
        best_feas[:] = slot_node
        fst[S_BEST_FEAS_COST] = C
        fst[S_BEST_FEAS_PEAK] = M
        ist[C_SNAP_FEAS_IT] = it
        ist[C_PENDING_FEAS] = 0
    if ist[C_HAVE_ANY] == 0 or cur < fst[S_BEST_ANY_OBJ] * (1 - 1e-12):
        if ist[C_HAVE_ANY] == 0 or it - ist[C_SNAP_ANY_IT] >= snap_gap:
            best_any[:] = slot_node
            fst[S_BEST_ANY_OBJ] = cur
            fst[S_BEST_ANY_COST] = C
            fst[S_BEST_ANY_PEAK] = M
            ist[C_SNAP_ANY_IT] = it
            ist[C_HAVE_ANY] = 1
            ist[C_PENDING_ANY] = 0
        else:
            ist[C_PENDING_ANY] = 1


# --------------------------------------------------------------------- building a state
@njit(cache=True)
def build(seq, T, size, succ_ptr, succ_idx, mem, extra, cost, is_out, slot_node, slot_end, nxt,
          prv, head, ncopy, multi, mpos, tr, lz, fst, ist):
    """Lay ``seq`` (node ids, repeats allowed) evenly over T slots and compute every interval.

    The caller guarantees the sequence is valid (every input before its reader).
    """
    n = head.shape[0]
    m = seq.shape[0]
    slot_node[:] = -1
    slot_end[:] = -1
    nxt[:] = -1
    prv[:] = -1
    head[:] = -1
    ncopy[:] = 0
    mpos[:] = -1
    ist[C_MULTI] = 0
    last = np.full(n, -1, np.int64)
    c = 0.0
    for k in range(m):
        t = (k * T) // m + (T // m) // 2
        v = seq[k]
        slot_node[t] = v
        if last[v] == -1:
            head[v] = t
        else:
            nxt[last[v]] = t
            prv[t] = last[v]
        last[v] = t
        ncopy[v] += 1
        c += cost[v]
    for v in range(n):
        if ncopy[v] >= 2:
            _multi_add(v, multi, mpos, ist)
    fst[S_COST] = c
    diff = np.zeros(T + 1, np.int64)
    for t in range(T):
        v = slot_node[t]
        if v >= 0:
            e = _scan_end(v, t, nxt[t], T, succ_ptr, succ_idx, head, nxt, is_out)
            slot_end[t] = e
            diff[t] += mem[v] + extra[v]
            diff[t + 1] -= extra[v]
            diff[e + 1] -= mem[v]
    tr[:] = 0
    lz[:] = 0
    run = 0
    for t in range(T):
        run += diff[t]
        tr[size + t] = run
    for p in range(size - 1, 0, -1):
        a = tr[2 * p]
        b = tr[2 * p + 1]
        tr[p] = a if a > b else b


@njit(cache=True)
def compact(slot_node):
    """The compute sequence of a slot array (no-ops dropped)."""
    k = 0
    for t in range(slot_node.shape[0]):
        if slot_node[t] >= 0:
            k += 1
    out = np.empty(k, np.int64)
    k = 0
    for t in range(slot_node.shape[0]):
        if slot_node[t] >= 0:
            out[k] = slot_node[t]
            k += 1
    return out


@njit(cache=True)
def check_state(T, size, pred_ptr, pred_idx, succ_ptr, succ_idx, mem, extra, is_out, slot_node,
                slot_end, nxt, head, tr, lz):
    """Recompute every interval and slot memory from scratch; return the number of mismatches
    (0 when the incremental state is exact). For tests."""
    bad = 0
    diff = np.zeros(T + 1, np.int64)
    for t in range(T):
        v = slot_node[t]
        if v >= 0:
            e = _scan_end(v, t, nxt[t], T, succ_ptr, succ_idx, head, nxt, is_out)
            if e != slot_end[t]:
                bad += 1
            diff[t] += mem[v] + extra[v]
            diff[t + 1] -= extra[v]
            diff[e + 1] -= mem[v]
            for k in range(pred_ptr[v], pred_ptr[v + 1]):
                if head[pred_idx[k]] == -1 or head[pred_idx[k]] >= t:
                    bad += 1
    run = 0
    for t in range(T):
        run += diff[t]
        if seg_point(tr, lz, size, t) != run:
            bad += 1
    return bad
