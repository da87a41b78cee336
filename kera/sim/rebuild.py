"""The broker's rebuilding of frozen vsegs' lost copies, driven in the simulation.

The decisions are the broker's own ``Rebuilder`` (which vsegs are short, which copies are
sources, which backups get the new copies, which are avoided, which copies a restarted
backup no longer holds whole). What is simulated is its I/O:
a copy is read from its source's chunks up to a corrupt one (then from the next source) and
written to its target by the ``BackupStore`` rules, from the target's length when it holds a
prefix already; the answer arrives after a network delay. Invariants: a source never holds
other chunks than the vseg recorded; once faults stopped, backups lost for good one after
the other (``lose``) leave every closed vseg whole again on ``need`` live backups, and the
recovery that follows gets every acknowledged chunk back.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from ..broker.rebuild import Rebuilder

RETRY = 1.0


class SimRebuild:
    def __init__(self, world, rpc_timeout: float, dead_after: float):
        self.w = world
        self.rpc_timeout, self.dead_after = rpc_timeout, dead_after
        self.rng = random.Random(world.seed ^ 0xB17D)   # its own: other draws stay as they were
        self.reps = [SimpleNamespace(log=v) for v in world.vlogs]
        self.rb = Rebuilder(None, None, None, world.set, lambda: self.reps, lambda: {})
        self.busy: set = set()   # (vlog, vseg) with a copy in flight
        self.due = False         # a retry pass is scheduled

    def run(self) -> None:
        """One pass, as after a membership change."""
        w, rb = self.w, self.rb
        if w.broker_dead:
            return
        rb.avoid = {b: t for b, t in rb.avoid.items() if t > w.now}
        short = False
        ids = {v.id for v in w.vlogs}
        for b in rb.changed():   # what it reloaded, as its ``list`` answers
            w.stats["copies_dropped"] += rb.verify(b, w.backups[b].listing(ids))
        orphans = rb.orphans()   # no whole copy known: a stray one may be on a live backup
        for b in rb.to_search(orphans):
            w.stats["strays_found"] += rb.found(b, w.backups[b].listing(ids), orphans)
        for r, vs in rb.todo():
            v = r.log
            if (v.id, vs.id) in self.busy:
                continue
            sources = sorted(rb.whole(vs), key=lambda b: b in rb.avoid)
            targets = rb.targets(vs, v.need - len(sources)) if sources else []
            if not targets:
                short = True
                continue
            t = targets[0]   # one copy at a time per vseg: the next pass makes the next one
            rb.partial[vs] = t
            self.busy.add((v.id, vs.id))
            w.at(w.now + self.rng.expovariate(1 / w.delay), self._copy, v, vs, sources, t,
                 w.set.incarnation(t))
        if short:
            self._retry()

    def _retry(self) -> None:
        if not self.due:
            self.due = True
            self.w.at(self.w.now + RETRY, self._again)

    def _again(self) -> None:
        self.due = False
        self.run()

    def _copy(self, v, vs, sources: list[int], t: int, inc: int) -> None:
        w = self.w
        key = (1, v.id, vs.id)
        mine = [c for c in w.by_vlog[v.id] if c.vseg == vs.id]   # the vseg's chunks, in order
        tb = w.backups[t]
        at, ok, target_failed = 0, False, False
        for src in sources:
            sb = w.backups[src]
            rep = sb.replicas.get(key)
            if not sb.up or sb.paused_until > w.now or rep is None:
                continue
            stop = min([i for i in rep.bad if i >= at] + [len(rep.chunks)])
            piece = rep.chunks[at:stop]
            if [cid for cid, _ in piece] != [c.cid for c in mine[at:at + len(piece)]]:
                w.fail(f"backup {src}'s copy of vlog {v.id} vseg {vs.id} holds other chunks than "
                       f"the vseg recorded")
            if not piece:
                continue
            if not tb.up or tb.paused_until > w.now:
                target_failed = True
                break
            close = at + len(piece) == len(mine)
            end = self._write(tb, v, vs, mine, at, piece, close)
            if end is None:
                target_failed = True
                break
            at = end
            if at == len(mine):
                ok = True
                break
        w.at(w.now + self.rng.expovariate(1 / w.delay), self._done, v, vs, t, inc, ok, target_failed)

    @staticmethod
    def _write(tb, v, vs, mine: list, at: int, piece: list, close: bool) -> int | None:
        """``piece`` (chunks ``at``...) to the target, continued from its length if it holds a
        prefix; the number of chunks it then holds, None if it refused."""
        ends = [c.voff + c.size for c in mine]
        off = ends[at - 1] if at else 0
        kind, val = tb.replicate(v.id, vs.id, off, piece, close)
        if kind == "length" and val in ends and val != off:   # a prefix of the same chunks
            j = ends.index(val) + 1
            if j >= at + len(piece):
                return j if not close or tb.replicas[(1, v.id, vs.id)].closed else None
            kind, val = tb.replicate(v.id, vs.id, val, piece[j - at:], close)
        return at + len(piece) if kind == "ok" else None

    def _done(self, v, vs, t: int, inc: int, ok: bool, target_failed: bool) -> None:
        w, rb = self.w, self.rb
        self.busy.discard((v.id, vs.id))
        if w.broker_dead:
            return
        if ok and rb.made(vs, t, inc):
            w.stats["rebuilt"] += 1
            w.note(f"vlog {v.id} vseg {vs.id}: copy made again on backup {t}")
            self.run()
            return
        if target_failed:
            rb.avoid[t] = w.now + self.rpc_timeout
        self._retry()

    def short(self) -> list:
        """Vsegs held whole (at their size, and closed if they are) by fewer than ``need`` live
        backups, as the backups themselves hold them: the open ones the vlog sends again from
        memory, the closed ones it sends again or the rebuilder copies."""
        w = self.w
        out = []
        live = [b for b in w.backups.values() if b.up and not b.declared_dead]
        for v in w.vlogs:
            for vs in v.vsegs[v.floor:]:
                if vs.size:
                    n = sum(1 for b in live if (r := b.replicas.get((1, v.id, vs.id))) is not None
                            and r.closed >= vs.closed and r.length == vs.size and not r.bad)
                    if n < v.need:
                        out.append((v.id, vs.id, n))
        return out

    def lose(self) -> None:
        """Backups lost for good one after the other, each once the copies are whole again:
        more losses over time than copies at once, evicted data included. The first one too
        waits for the faults' own losses to be repaired: a backup destroyed late in the faults
        may not even be declared dead yet, and losing another holder of its frozen vsegs then
        would be two losses at once, which R-1 copies of evicted data cannot survive."""
        w = self.w
        if min(v.need for v in w.vlogs) < 2:
            return   # one backup copy: losing its backup loses it (the broker's memory aside)
        self._whole_again("the faults healed")
        for _ in range(2):
            live = [b for b in w.backups.values() if b.up and not b.destroyed]
            if len(live) <= max(v.need for v in w.vlogs):
                return   # no backup left to copy to after this loss
            held = {b.id: sum(1 for k in b.replicas if k[0] == 1) for b in live}
            b = max(live, key=lambda b: (held[b.id], b.id))
            w.note(f"backup {b.id} lost for good")
            b.up, b.destroyed = False, True
            b.replicas.clear()
            w.stats["lost_for_good"] += 1
            w.at(w.now + self.dead_after, w.faults.declare_dead, b, b.incarnation)
            self._whole_again(f"backup {b.id} was lost")

    def _whole_again(self, after: str) -> None:
        """Run until every backup is back as a member, or declared dead if it was lost, and
        every vseg is whole again on ``need`` live backups (and every chunk durable); fail if
        that takes over a minute."""
        w = self.w
        w.run_until(w.now + self.dead_after + 60.0, lambda: not self._astray() and all(
            v.durable == v.appended for v in w.vlogs) and not self.short())
        if self._astray():
            w.fail(f"after {after}, backups neither back nor declared dead: {self._astray()}")
        if self.short():
            w.fail(f"copies not made again after {after}: (vlog, vseg, whole copies) "
                   f"{self.short()[:5]}")

    def _astray(self) -> list[int]:
        """Backups neither back as members nor, lost for good, declared dead."""
        return [b.id for b in self.w.backups.values()
                if (not b.declared_dead if b.destroyed else not b.up or b.declared_dead)]
