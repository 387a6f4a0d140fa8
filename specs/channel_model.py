"""Exhaustive model of the request channel's give-backs under x86-TSO.

The code it models: ``replay_fsm/data/channel.py`` (``Channel.put``, ``get``,
``restore_taken``, ``restore_spaces``) and the restart's use of them in
``replay_fsm/data/packer.py`` (``Packer.attach``, ``service``'s ``items_owed`` and
``places_owed`` retries, the ``UNSURE`` cell). specs/LEARNER_PACKS.md says what it found; run
``python specs/channel_model.py [NAME ...]`` (each case, or those whose name holds
a NAME; ``-v`` prints a path to each fault), or tests/test_channel_model.py. Built
by helper-115 (the ring), helper-118 (UNSURE read after the measurement, the rule
for a put under way), helper-121 (a collector attaching without the claim lock
beside later ``service`` readings), 2026-12-07, and helper-126 (the items' reading
retried at ``service`` calls, item C).

A  (soundness) where the restart reads UNSURE: before its measurement (the old
   code) or after it, just before it gives anything back (the code now), against
   a second collector that attaches without the claim lock (stores UNSURE, then
   gets).
B  (liveness) the learner waiting for a place while every place is lost: a reading
   that finds a put in flight (begun == settled + 1, begun unmoved) gives back the
   shortfall minus one (the code now) or nothing (before).
C  (liveness) the attach's reading of the items finds the learner's put between its
   count and its release all through (the learner descheduled there): the item D
   took is given back at a later service call's reading (the code now), or never
   (before: R reads every record one behind, and the newest never).

Actors, every interleaving explored:
- P, the learner, the one producer: PUTS puts as Channel.put makes them (closed
  check, begun store, spaces acquire -- or time out, where allowed --, closed check,
  slot write, tail store, settled store, items release, released store); optionally
  a signal's exception after its acquire (settled stored, the place lost for good).
- D, the collector that dies: one get (items acquire, closed check, read slot, head
  store, spaces release), killed at any step (its stores reach memory: it exited).
- R, the restart, once D is dead: the attach (restore_taken's reading, retried or
  given up at will, the items then owed; restore_spaces' one reading), then for
  ever: a service call (restore_taken's one reading while items are owed, then
  restore_spaces' while places are) and a get(timeout=0).
- A2 (item A): a collector attaching beside R without the claim lock: stores UNSURE,
  then gets for ever. R then only attaches (no gets), so that every fault found is
  a give-back's, not two readers' sharing the head.
- C, a closer (optional): closed store, items release, spaces release.

Memory: each actor's plain stores go to its FIFO store buffer, drained to memory at
any later step; its loads see its own buffer first; a semaphore operation is a locked
instruction: taken only with the actor's buffer empty, atomic on memory.

Checked at every step: a slot store reaching memory over a record not read
("overwrite"); a get reading a slot that holds another record than its head ("wrong
read"); a record read twice ("read twice"); and, as ghost counts, places or items
given back beyond those truly lost or taken ("over-give places/items"). Liveness
(no timeouts for P): from every reachable state, one where every put is done (or the
channel closed) is reachable ("stuck" counts the states from which none is); with
``reads_live``, every put done and every record it counted read.
"""
# ruff: noqa: B023 (each step's closures run within the step that makes them)

from __future__ import annotations

import sys
from collections import defaultdict

# put steps
P_CHK, P_BEGUN, P_ACQ, P_CHK2, P_WRITE, P_TAIL, P_SETTLED, P_REL, P_RELD = range(9)
PUT = [P_CHK, P_BEGUN, P_ACQ, P_CHK2, P_WRITE, P_TAIL, P_SETTLED, P_REL, P_RELD]
# get steps
G_ACQ, G_CHK, G_READ, G_HEAD, G_REL, G_DONE = range(6)


def explore(*, cap=2, puts=2, t0=0, h0=0, lost0=0, taken0=0, closer=False,
            signal=False, timeouts=True, d_get=True, a2=False, unsure_after=True,
            in_flight=True, mutant=None, liveness=False, limit=3_000_000, a2_svc=False,
            items_retry=True, reads_live=False):
    put_order = list(PUT)
    if mutant == "begun after acquire":
        put_order = [P_CHK, P_ACQ, P_BEGUN, P_CHK2, P_WRITE, P_TAIL, P_SETTLED, P_REL,
                     P_RELD]
    if mutant == "settled before tail":
        put_order = [P_CHK, P_BEGUN, P_ACQ, P_CHK2, P_WRITE, P_SETTLED, P_TAIL, P_REL,
                     P_RELD]
    sp_reads = ["begun", "settled", "tail", "spaces", "begun2", "head", "closed"]
    if mutant == "begun not read again":
        sp_reads.remove("begun2")
    if unsure_after:
        sp_reads.append("unsure")
    it_reads = ["tail", "released", "items", "released2", "tail2", "head", "closed"]
    if unsure_after:
        it_reads.append("unsure")

    slots = [-1] * cap
    for r in range(max(0, t0 - cap), t0):
        slots[r % cap] = r
    mem0 = dict(head=h0, tail=t0, closed=0, released=t0, begun=0, settled=0,
                items=t0 - h0 - taken0, spaces=cap - (t0 - h0) - lost0, unsure=0)
    assert mem0["items"] >= 0 and mem0["spaces"] >= 0
    for i, r in enumerate(slots):
        mem0[f"slot{i}"] = r
    keys = sorted(mem0)
    kidx = {k: i for i, k in enumerate(keys)}

    # ghosts: (read set, lost places, places given, items taken, items given)
    # P: (k, step, buf, begun_n, tail_n)
    # D: (pc, buf, dead)          R: (phase, j, regs, owed, buf)   A2: (pc, buf)
    def initial():
        return (tuple(mem0[k] for k in keys), frozenset(range(h0)), lost0, 0, taken0, 0,
                (0, 0, (), 0, 0), (G_ACQ, (), not d_get), ("it", 0, (), (False, True), ()),
                (-1, ()) if a2 else None, 0)

    bad = defaultdict(int)
    examples = {}
    gave = [0, 0]  # readings that gave places, items back (not vacuous)
    start = initial()
    seen = {start: None}
    edges: dict = defaultdict(list) if liveness else None
    stack = [start]

    def view(memt, buf, key):
        for k, v in reversed(buf):
            if k == key:
                return v
        return memt[kidx[key]]

    def setm(memt, **kw):
        m = list(memt)
        for k, v in kw.items():
            m[kidx[k]] = v
        return tuple(m)

    while stack:
        st = stack.pop()
        memt, rs, lost, given, taken, igiven, P, D, R, A, cpc = st
        succ = []

        def flag(kind):
            bad[kind] += 1
            examples.setdefault(kind, st)

        def drain(buf, who):
            k, v = buf[0]
            if k.startswith("slot"):
                old = memt[kidx[k]]
                if old >= 0 and old != v and old not in rs:
                    flag("overwrite")
            return setm(memt, **{k: v}), buf[1:]

        def get_steps(pc, buf, reads_set):
            """One get's next steps: [(mem, readset, pc, buf, note)]; note 'empty'
            when no item is there (get(timeout=0) returns None)."""
            out = []
            if pc == G_ACQ:
                if not buf:
                    if memt[kidx["items"]] > 0:
                        out.append((setm(memt, items=memt[kidx["items"]] - 1), reads_set,
                                    G_CHK, buf, None))
                    else:
                        out.append((memt, reads_set, G_ACQ, buf, "empty"))
            elif pc == G_CHK:
                if view(memt, buf, "closed"):
                    if not buf:
                        out.append((setm(memt, items=memt[kidx["items"]] + 1), reads_set,
                                    G_DONE, buf, "closed"))
                else:
                    out.append((memt, reads_set, G_READ, buf, None))
            elif pc == G_READ:
                h = view(memt, buf, "head")
                if view(memt, buf, f"slot{h % cap}") != h:
                    flag("wrong read")
                if h in reads_set:
                    flag("read twice")
                out.append((memt, reads_set, G_HEAD, buf, None))
            elif pc == G_HEAD:  # counted read: the ghost set holds counted records
                out.append((memt, reads_set | {view(memt, buf, "head")}, G_REL,
                            buf + (("head", view(memt, buf, "head") + 1),), None))
            elif pc == G_REL and not buf:
                out.append((setm(memt, spaces=memt[kidx["spaces"]] + 1), reads_set,
                            G_DONE, buf, None))
            return out

        # ---- P
        k, si, pbuf, bn, tn = P
        if k < puts:
            op = put_order[si]
            nxt = (k, si + 1, pbuf, bn, tn)
            begun_first = put_order.index(P_BEGUN) < si
            if op == P_CHK:
                if view(memt, pbuf, "closed"):
                    succ.append(("P", memt, rs, lost, given, (puts, 0, pbuf, 0, 0)))
                else:
                    succ.append(("P", memt, rs, lost, given, nxt))
            elif op == P_BEGUN:
                n = view(memt, pbuf, "begun") + 1
                succ.append(("P", memt, rs, lost, given,
                             (k, si + 1, pbuf + (("begun", n),), n, tn)))
            elif op == P_ACQ:
                if not pbuf:
                    if memt[kidx["spaces"]] > 0:
                        succ.append(("P", setm(memt, spaces=memt[kidx["spaces"]] - 1), rs,
                                     lost, given, nxt))
                    elif timeouts:
                        b = bn if begun_first else view(memt, pbuf, "begun")
                        nb = pbuf + (("settled", b),) if begun_first else pbuf
                        succ.append(("P", memt, rs, lost, given, (k + 1, 0, nb, 0, 0)))
            elif op == P_CHK2:
                if view(memt, pbuf, "closed"):
                    if not pbuf:
                        b = bn if bn else view(memt, pbuf, "begun")
                        succ.append(("P", setm(memt, spaces=memt[kidx["spaces"]] + 1), rs,
                                     lost, given, (puts, 0, (("settled", b),), 0, 0)))
                else:
                    succ.append(("P", memt, rs, lost, given, nxt))
            elif op == P_WRITE:
                t = view(memt, pbuf, "tail")
                succ.append(("P", memt, rs, lost, given,
                             (k, si + 1, pbuf + ((f"slot{t % cap}", t),), bn, tn)))
            elif op == P_TAIL:
                t = view(memt, pbuf, "tail") + 1
                succ.append(("P", memt, rs, lost, given,
                             (k, si + 1, pbuf + (("tail", t),), bn, t)))
            elif op == P_SETTLED:
                b = bn if bn else view(memt, pbuf, "begun")
                succ.append(("P", memt, rs, lost, given,
                             (k, si + 1, pbuf + (("settled", b),), bn, tn)))
            elif op == P_REL:
                if not pbuf:
                    succ.append(("P", setm(memt, items=memt[kidx["items"]] + 1), rs, lost,
                                 given, nxt))
            elif op == P_RELD:
                t = tn if tn else view(memt, pbuf, "tail")
                succ.append(("P", memt, rs, lost, given,
                             (k + 1, 0, pbuf + (("released", t),), 0, 0)))
            if signal and put_order.index(P_ACQ) < si <= put_order.index(P_TAIL):
                b = bn if bn else view(memt, pbuf, "begun")
                succ.append(("P", memt, rs, lost + 1, given,
                             (k + 1, 0, pbuf + (("settled", b),), 0, 0)))
        if pbuf:
            m, nb = drain(pbuf, "P")
            succ.append(("P", m, rs, lost, given, (k, si, nb, bn, tn)))

        # ---- D: one get, killed at any step
        dpc, dbuf, dead = D
        if not dead:
            for m, rs2, pc2, b2, note in get_steps(dpc, dbuf, rs):
                if note != "empty":
                    succ.append(("D", m, rs2, lost, given, (pc2, b2, False)))
            if dbuf:
                m, nb = drain(dbuf, "D")
                succ.append(("D", m, rs, lost, given, (dpc, nb, False)))
            if mutant != "D alive":
                m = memt
                for key, val in dbuf:
                    m = setm(m, **{key: val})
                nl = lost + (dpc == G_REL)
                nt = taken + (dpc in (G_CHK, G_READ, G_HEAD) and
                              not any(kk == "head" for kk, _ in dbuf))
                succ.append(("Dt", m, rs, nl, given, (dpc, (), True), nt))

        # ---- R
        phase, j, regs, owed, rbuf = R  # owed: (items, places) still to give back
        r_on = dead if mutant != "D alive" else True
        if r_on and phase != "end":
            def rd(key):
                if key in ("begun2",):
                    return view(memt, rbuf, "begun")
                if key in ("released2",):
                    return view(memt, rbuf, "released")
                if key == "tail2":
                    return view(memt, rbuf, "tail")
                return view(memt, rbuf, key)

            def service(owed2, buf):
                """A service call's first step: its readings while anything is owed
                (the items first, as ``Packer._give_back``); the next get, or the end
                where R only attaches."""
                if owed2[0]:
                    return ("svi", 0, (), owed2, buf)
                if owed2[1] or not a2:
                    return ("svc", 0, (), owed2, buf)
                return ("end", 0, (), owed2, buf)

            def after_service(owed2, buf):
                if not a2:
                    return ("get", G_ACQ, (), owed2, buf)
                return service(owed2, buf) if a2_svc else ("end", 0, (), owed2, buf)

            if phase in ("it", "svi"):  # restore_taken: the attach's, then service's
                if j == 0 and not unsure_after and view(memt, rbuf, "unsure"):
                    nxt = (("end" if a2 else "svc", 0, (), (False, False), rbuf)
                           if phase == "it" else after_service((False, False), rbuf))
                    succ.append(("R", memt, rs, lost, given, nxt))
                elif j < len(it_reads):
                    key = it_reads[j]
                    regs2 = regs + ((key, rd(key)),)
                    if key == "tail2":
                        rg = dict(regs2)
                        unchecked = phase == "svi" and mutant == "service's items: no check"
                        if not unchecked and not (
                                rg["tail"] == rg["released"] == rg["released2"]
                                == rg["tail2"]):
                            # no reading: the attach retries, or its patience is out
                            # (0 given back, the item owed where ``items_retry``);
                            # a service call reads once
                            if phase == "it":
                                succ.append(("R", memt, rs, lost, given,
                                             ("it", 0, (), owed, rbuf)))
                                succ.append(("R", memt, rs, lost, given,
                                             ("sp", 0, (), (items_retry, owed[1]), rbuf)))
                            else:
                                succ.append(("R", memt, rs, lost, given,
                                             ("svc", 0, (), owed, rbuf)))
                            regs2 = None
                    if regs2 is not None:
                        succ.append(("R", memt, rs, lost, given, (phase, j + 1, regs2, owed,
                                                                rbuf)))
                else:
                    rg = dict(regs)
                    n = rg["tail"] - rg["head"] - rg["items"]
                    unsure = rg.get("unsure") and not (
                        phase == "svi" and mutant == "service's items: alone unasked")
                    if rg["closed"] or n <= 0 or unsure:
                        n = 0
                    if n and rbuf:
                        pass  # a locked release waits for the buffer
                    else:
                        m = setm(memt, items=memt[kidx["items"]] + n)
                        if n:
                            gave[1] += 1
                        succ.append(("Ri", m, rs, lost, given,
                                     ("sp" if phase == "it" else "svc", 0, (),
                                      (False, owed[1]), rbuf), n))
            elif phase in ("sp", "svc"):  # restore_spaces: attach's, then service's
                if phase == "svc" and not owed[1]:
                    succ.append(("R", memt, rs, lost, given, after_service(owed, rbuf)))
                elif (phase == "svc" and j == 0 and not unsure_after
                      and view(memt, rbuf, "unsure")):
                    succ.append(("R", memt, rs, lost, given,
                                 after_service((False, False), rbuf)))
                elif j < len(sp_reads):
                    key = sp_reads[j]
                    succ.append(("R", memt, rs, lost, given,
                                 (phase, j + 1, regs + ((key, rd(key)),), owed, rbuf)))
                else:
                    rg = dict(regs)
                    b, s = rg["begun"], rg["settled"]
                    steady = rg.get("begun2", b) == b
                    n = cap - (rg["tail"] - rg["head"]) - rg["spaces"]
                    if mutant == "no check":
                        exact, flight = True, False
                    else:
                        exact = steady and b == s
                        flight = in_flight and steady and b == s + 1
                    if mutant == "in flight: all of it":
                        flight_keep = 0
                    else:
                        flight_keep = 1
                    if exact:
                        give, owed2 = n, False
                    elif flight:
                        give, owed2 = n - flight_keep, True
                    else:
                        give, owed2 = 0, True
                    if rg["closed"] or rg.get("unsure"):
                        give, owed2 = 0, False
                    give = max(0, give)
                    if give and rbuf:
                        pass
                    else:
                        m = setm(memt, spaces=memt[kidx["spaces"]] + give)
                        if give:
                            gave[0] += 1
                        owed3 = (owed[0], owed2)
                        if phase == "sp" and a2 and not a2_svc:
                            nxt = ("end", 0, (), owed3, rbuf)
                        elif phase == "sp" and a2:
                            nxt = service(owed3, rbuf)
                        else:
                            nxt = after_service(owed3, rbuf)
                        succ.append(("R", m, rs, lost, given + give, nxt))
            elif phase == "get":
                for m, rs2, pc2, b2, note in get_steps(j, rbuf, rs):
                    if note == "empty" or pc2 == G_DONE:
                        nxt = (("end", 0, (), owed, b2) if note == "closed"
                               else service(owed, b2))
                        succ.append(("R", m, rs2, lost, given, nxt))
                    else:
                        succ.append(("R", m, rs2, lost, given, ("get", pc2, (), owed, b2)))
        if rbuf:
            m, nb = drain(rbuf, "R")
            succ.append(("R", m, rs, lost, given, (phase, j, regs, owed, nb)))

        # ---- A2: attaches without the claim lock once D is dead, then gets
        if A is not None and dead:
            apc, abuf = A
            if apc == -1:
                succ.append(("A", memt, rs, lost, given, (G_ACQ, (("unsure", 1),))))
            else:
                for m, rs2, pc2, b2, note in get_steps(apc, abuf, rs):
                    if note == "closed":
                        continue
                    succ.append(("A", m, rs2, lost, given,
                                 (G_ACQ if pc2 == G_DONE or note == "empty" else pc2, b2)))
            if abuf:
                m, nb = drain(abuf, "A")
                succ.append(("A", m, rs, lost, given, (apc, nb)))

        # ---- C
        if closer and cpc < 3:
            if cpc == 0:
                m = setm(memt, closed=1)
            elif cpc == 1:
                m = setm(memt, items=memt[kidx["items"]] + 1)
            else:
                m = setm(memt, spaces=memt[kidx["spaces"]] + 1)
            succ.append(("C", m, rs, lost, given, None))

        for item in succ:
            who, m, rs2, lo, gi, new = item[:6]
            nP, nD, nR, nA, ncpc, ntaken, nig = P, D, R, A, cpc, taken, igiven
            if who == "P":
                nP = new
            elif who == "D":
                nD = new
            elif who == "Dt":
                nD, ntaken = new, item[6]
            elif who == "R":
                nR = new
            elif who == "Ri":
                nR, nig = new, igiven + item[6]
            elif who == "A":
                nA = new
            else:
                ncpc = cpc + 1
            if gi > lo:
                flag("over-give places")
            if nig > ntaken:
                flag("over-give items")
            ns = (m, rs2, lo, gi, ntaken, nig, nP, nD, nR, nA, ncpc)
            if liveness:
                edges[ns].append(st)
            if ns not in seen:
                seen[ns] = st
                stack.append(ns)
                if len(seen) > limit:
                    raise RuntimeError("state limit")
    stuck = 0
    if liveness:
        goal = [s for s in seen if s[0][kidx["closed"]] or (
            s[6][0] >= puts and (not reads_live or (
                not s[6][2] and s[0][kidx["head"]] == s[0][kidx["tail"]])))]
        ok = set(goal)
        work = list(goal)
        while work:
            s = work.pop()
            for p in edges.get(s, ()):
                if p not in ok:
                    ok.add(p)
                    work.append(p)
        stuck = len(seen) - len(ok)
        if stuck:
            examples.setdefault("stuck", next(s for s in seen if s not in ok))
    if stuck:
        bad["stuck"] = stuck
    return len(seen), dict(bad), gave, examples, seen, keys


def show(example, seen, keys):
    chain = []
    s = example
    while s is not None:
        chain.append(s)
        s = seen[s]
    for x in reversed(chain):
        mem = dict(zip(keys, x[0], strict=True))
        print("   ", mem, "read", sorted(x[1]), "lost/given", x[2], x[3],
              "taken/igiven", x[4], x[5], "P", x[6], "D", x[7], "R", x[8], "A2", x[9])


B = dict(cap=2, timeouts=False, liveness=True)
CASES = [
    # --- item B: the learner waits for a place while every place is lost
    ("B sound: all lost, ring empty, 2 puts", dict(B, lost0=2, puts=2)),
    ("B sound: 1 record, the rest lost, D killed in a get", dict(B, cap=3, lost0=2, t0=1,
                                                             puts=2)),
    ("B sound: 1 lost, 1 record, D killed anywhere", dict(B, lost0=1, t0=1, puts=3)),
    ("B sound: none lost, D killed anywhere, 3 puts", dict(B, t0=1, puts=3)),
    ("B sound: cap 3, 2 lost, 1 record, 3 puts", dict(B, cap=3, lost0=2, t0=1, puts=3)),
    ("B sound: item taken, place lost", dict(B, cap=3, lost0=1, t0=2, taken0=1, puts=2)),
    ("B sound: with timeouts, a closer", dict(cap=2, lost0=1, t0=1, puts=2, closer=True)),
    ("B sound: with timeouts, a signal", dict(cap=2, lost0=1, t0=1, puts=3, signal=True)),
    ("B sound: closer, no timeouts", dict(B, lost0=2, puts=2, closer=True)),
    ("B main (no in-flight rule): all lost, ring empty",
     dict(B, lost0=2, puts=2, in_flight=False), "stuck"),
    ("B mutant: in flight, all of the shortfall given",
     dict(B, lost0=1, t0=1, puts=3, mutant="in flight: all of it"), "over"),
    ("B mutant: begun stored after the acquire",
     dict(B, lost0=1, t0=1, puts=3, mutant="begun after acquire"), "over"),
    ("B mutant: settled stored before tail",
     dict(B, lost0=1, t0=1, puts=3, mutant="settled before tail"), "over"),
    ("B mutant: begun not read again",
     dict(B, lost0=1, t0=1, puts=3, mutant="begun not read again"), "over"),
    ("B mutant: no check", dict(B, lost0=1, t0=1, puts=2, mutant="no check"), "over"),
    ("B mutant: D alive beside R", dict(B, t0=1, puts=2, mutant="D alive"), "over"),
    # --- item A: a second collector attaching beside the restart without the lock
    ("A fixed (UNSURE read after): 1 lost, 1 record", dict(cap=2, t0=2, h0=1, lost0=1,
                                                          a2=True, puts=1, d_get=False)),
    ("A fixed: 1 item taken, 2 records", dict(cap=3, t0=2, taken0=1, a2=True, puts=1,
                                             d_get=False)),
    ("A fixed: D killed anywhere, 1 record", dict(cap=2, t0=2, a2=True, puts=1)),
    ("A main (UNSURE read before): 1 lost, 1 record",
     dict(cap=2, t0=2, h0=1, lost0=1, a2=True, puts=1, d_get=False, unsure_after=False),
     "over"),
    ("A main: 1 item taken, 2 records",
     dict(cap=3, t0=2, taken0=1, a2=True, puts=1, d_get=False, unsure_after=False),
     "over"),
    ("A main exactly (UNSURE before, no in-flight rule): 1 lost, 1 record",
     dict(cap=2, t0=2, h0=1, lost0=1, a2=True, puts=1, d_get=False, unsure_after=False,
          in_flight=False), "over"),
    ("A main exactly: D killed anywhere",
     dict(cap=2, t0=2, a2=True, puts=1, unsure_after=False, in_flight=False), "over"),
    ("A main: D killed anywhere",
     dict(cap=2, t0=2, a2=True, puts=1, unsure_after=False), "over"),
]

# the second collector beside the restart's later readings at service calls too
A2 = dict(a2=True, a2_svc=True, puts=2)
CASES += [
    ("A2 svc fixed: 1 lost, 1 record, put under way",
     dict(A2, cap=2, t0=2, h0=1, lost0=1, d_get=False)),
    ("A2 svc fixed: 2 lost, cap 3", dict(A2, cap=3, t0=1, h0=0, lost0=2, d_get=False)),
    ("A2 svc fixed: D killed anywhere", dict(A2, cap=2, t0=2)),
    ("A2 svc main (UNSURE before)",
     dict(A2, cap=2, t0=2, h0=1, lost0=1, d_get=False, unsure_after=False), "over"),
    ("B sound: cap 3, all lost, signal+timeouts", dict(cap=3, lost0=3, puts=3, signal=True)),
    ("B sound: cap 3, 1 lost 2 records, closer",
     dict(cap=3, lost0=1, t0=2, puts=2, closer=True, signal=True)),
]

# item C: the attach's reading of the items given up while the learner's put is
# between its count and its release, and read again at service calls (or never)
C = dict(cap=2, timeouts=False, liveness=True, reads_live=True)
CASES += [
    ("C fixed: D killed anywhere, 2 puts", dict(C, puts=2)),
    ("C fixed: item taken, 1 record, 2 puts", dict(C, t0=1, taken0=1, puts=2, d_get=False)),
    ("C fixed: cap 3, D killed anywhere, 3 puts", dict(C, cap=3, puts=3)),
    ("C fixed: with timeouts, a closer, a signal",
     dict(cap=2, puts=2, closer=True, signal=True)),
    ("C mutant: service's items reading unchecked", dict(C, puts=2,
                                                         mutant="service's items: no check"),
     "over"),
    ("C main (given up for good): D killed anywhere",
     dict(C, puts=2, items_retry=False), "stuck"),
    ("C main: item taken, 1 record", dict(C, t0=1, taken0=1, puts=2, d_get=False,
                                          items_retry=False), "stuck"),
    ("A2 svc fixed: items owed, 1 taken, 2 records",
     dict(A2, cap=3, t0=2, taken0=1, d_get=False)),
    ("A2 svc mutant: service's items reading asks no alone",
     dict(A2, cap=3, t0=2, taken0=1, d_get=False, mutant="service's items: alone unasked"),
     "over"),
    ("A2 svc main (UNSURE before): items owed",
     dict(A2, cap=3, t0=2, taken0=1, d_get=False, unsure_after=False), "over"),
]


def verdict(case: tuple) -> tuple[bool, str]:
    """Explore ``case`` (name, explore's arguments, what it must find: None for no
    fault and a give-back made, "stuck" for stuck states only, "over" for a fault
    other than stuck); whether it found that, and its line of the report."""
    name, kw = case[0], case[1]
    expect = case[2] if len(case) > 2 else None
    states, bad, gave, examples, seen, keys = explore(**kw)
    if expect is None:
        ok = not bad and bool(gave[0] or gave[1])
    elif expect == "stuck":
        ok = set(bad) == {"stuck"}
    else:
        ok = any(k != "stuck" for k in bad)
    return ok, (f"{name}: {states} states, places given back in {gave[0]} and items in "
                f"{gave[1]} readings; faults: {dict(bad) or 'none'}")


if __name__ == "__main__":
    wrong = 0
    only = [arg for arg in sys.argv[1:] if arg != "-v"]
    for case in CASES:
        if only and not any(o in case[0] for o in only):
            continue
        ok, line = verdict(case)
        print(line + ("" if ok else "\n   NOT AS EXPECTED"), flush=True)
        wrong += not ok
        if "-v" in sys.argv[1:]:
            _, bad, _, examples, seen, keys = explore(**case[1])
            for kind, ex in examples.items():
                print("  example of", kind)
                show(ex, seen, keys)
    print("as expected" if not wrong else f"{wrong} cases not as expected")
    sys.exit(1 if wrong else 0)
