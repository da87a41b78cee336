"""Faults of the simulated backups, at a seeded rate while ingesting: pauses (declared
dead past the failure detector's delay, then back as a new incarnation), crashes and
restarts, full disks, and, within a budget of copies that may be damaged (R - 2), bit
flips, torn tails and disks destroyed; then the heal, when every fault stops."""

from __future__ import annotations

from .backups import SimBackup

DEAD_AFTER = 2.0   # the failure detector's delay


class Faults:
    """The world's faults: ``rate`` a simulated second, on until the heal."""

    def __init__(self, world, rate: float):
        self.world = world
        self.rate = rate
        self.budget = max(0, world.replication - 2)  # backup copies that may rot or vanish
        self.damaged: set[int] = set()
        self.rotten = False   # a bit flipped in a file (rot a backup may not know of)
        self.on = True

    def run(self, until: float) -> None:
        w = self.world
        if w.now >= until or not self.on:
            return
        r = w.rng
        live = [b for b in w.backups.values() if b.up and not b.destroyed]
        kind = r.choice(("pause", "pause", "crash", "full", "flip", "torn", "destroy"))
        if live:
            b = r.choice(live)
            if kind == "pause" and b.paused_until <= w.now:
                d = r.choice((0.3, 1.5, 3.0, 8.0))
                b.paused_until = w.now + d
                w.note(f"pause backup {b.id} for {d}")
                if d > DEAD_AFTER:
                    w.at(w.now + DEAD_AFTER, self.declare_dead, b, b.incarnation)
                w.at(b.paused_until, self.resume, b, b.incarnation)
            elif kind == "crash":
                w.note(f"crash backup {b.id}")
                b.up = False
                w.at(w.now + DEAD_AFTER, self.declare_dead, b, b.incarnation)
                w.at(w.now + r.uniform(0.5, 6.0), self.restart, b)
            elif kind == "full":
                b.full = True
                w.note(f"disk full on backup {b.id}")
                w.at(w.now + r.uniform(0.5, 5.0), setattr, b, "full", False)
            elif kind in ("flip", "torn", "destroy") and self._may_damage(b):
                self._damage(b, kind)
        w.at(w.now + r.expovariate(self.rate), self.run, until)

    def _may_damage(self, b: SimBackup) -> bool:
        if b.id in self.damaged:
            return True
        if len(self.damaged) < self.budget:
            self.damaged.add(b.id)
            return True
        return False

    def _damage(self, b: SimBackup, kind: str) -> None:
        w = self.world
        reps = [rep for rep in b.replicas.values() if rep.chunks]
        if kind == "destroy":
            w.note(f"backup {b.id} destroyed with its disk")
            b.up, b.destroyed = False, True
            b.replicas.clear()
            w.at(w.now + DEAD_AFTER, self.declare_dead, b, b.incarnation)
            return
        if not reps:
            return
        rep = w.rng.choice(reps)
        if kind == "flip":  # a bit flipped: found on load or when read
            self.rotten = True
            i = w.rng.randrange(len(rep.chunks))
            rep.bad.add(i)
            if w.rng.random() < 0.5:
                rep.known_bad.add(i)
            if w.rng.random() < 0.5:
                rep.headers.add(i)
            w.note(f"bit flip on backup {b.id} chunk {rep.chunks[i][0]}")
        else:  # a torn tail: the backup process restarts with its file cut
            cut = w.rng.randrange(len(rep.chunks))
            w.note(f"torn tail on backup {b.id}: {len(rep.chunks) - cut} chunks cut")
            del rep.chunks[cut:]
            del rep.ends[cut:]
            rep.closed = False
            rep.bad = {i for i in rep.bad if i < cut}
            rep.known_bad = {i for i in rep.known_bad if i < cut}
            rep.headers = {i for i in rep.headers if i < cut}
            b.reload()
            b.incarnation += 1  # it restarted: a new incarnation, as after a crash, which
            b.declared_dead, b.paused_until = False, 0.0   # registers even if paused or dead before
            w.membership_changed()

    def declare_dead(self, b: SimBackup, incarnation: int) -> None:
        w = self.world
        if b.incarnation == incarnation and (not b.up or b.paused_until > w.now):
            b.declared_dead = True
            w.note(f"backup {b.id} declared dead")
            w.membership_changed()

    def resume(self, b: SimBackup, incarnation: int) -> None:
        w = self.world
        if b.incarnation == incarnation and b.up and b.declared_dead:
            b.incarnation += 1  # fenced out while paused: it registers again
            b.declared_dead = False
            w.note(f"backup {b.id} back as incarnation {b.incarnation}")
            w.membership_changed()

    def restart(self, b: SimBackup) -> None:
        w = self.world
        if b.destroyed or b.up:
            return
        b.up, b.declared_dead, b.paused_until = True, False, 0.0
        b.reload()
        b.incarnation += 1
        w.note(f"backup {b.id} restarted as incarnation {b.incarnation}")
        w.membership_changed()

    def heal(self) -> None:
        w = self.world
        self.on = False
        for b in w.backups.values():
            b.full = False
            if b.paused_until > w.now:
                b.paused_until = w.now
                self.resume(b, b.incarnation)
            if not b.up and not b.destroyed:
                self.restart(b)
        w.kick()
