"""The watchdog's diagnosis logic, with stand-in events (the GPU transports use it
with CUDA events; tests/gpu/test_symm.py and test_nvshmem.py run it for real): a
wait past the timeout is named, released once, and the process ends if it stays
stuck; a device failure names every wait then pending; `poll()` gives the same
diagnosis from the caller's thread, so a thread starved of the GIL loses nothing."""

import atexit

import pytest

from megatron_overlap.comm import watchdog as wd


class Event:
    def __init__(self, done=False, error=None):
        self.done, self.error = done, error

    def query(self):
        if self.error:
            raise RuntimeError(self.error)
        return self.done


class Clock:
    """The watchdog's clock, moved by the tests: no timing can flake."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


clock = Clock()


@pytest.fixture
def dog(monkeypatch):
    failures, released, exits = [], [], []
    monkeypatch.setattr(wd.os, "_exit", exits.append)
    monkeypatch.setattr(wd, "_clock", clock)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    d = wd.Watchdog(timeout_s=0.2, on_failure=failures.append, poll_s=3600, abort_after_s=0.2)
    d.failures, d.released, d.exits, d.others = failures, released, exits, []
    yield d
    for w in [d, *d.others]:  # nothing left for the (sleeping) thread or atexit to act on
        w._pending.clear()
        atexit.unregister(w._at_exit)


def test_a_wait_past_the_timeout_is_named_released_then_ends_the_process(dog, capfd):
    stuck = Event()
    dog._add(Event(done=True), "rank 0/2 waited for the barrier starting 'fc1_fprop'", lambda: None)
    dog._add(stuck, "rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1",
             lambda: dog.released.append(1))
    dog.poll()
    assert not dog.overdue() and not dog.failures  # within the timeout: nothing said
    clock.sleep(0.25)
    assert dog.overdue()
    dog.poll()
    assert dog.failures == ["rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1 "
                            "(still pending after 0.2s)"]
    assert dog.released == [1]
    assert "megatron_overlap watchdog: rank 0/2 waited for 'fc1_fprop' chunk 1" in capfd.readouterr().err
    dog.poll()
    assert dog.released == [1] and not dog.exits  # released once; not yet given up
    clock.sleep(0.25)
    dog.poll()
    assert dog.exits == [124] and len(dog.failures) == 1
    assert "ending the process rather than hang" in capfd.readouterr().err


def test_a_released_wait_that_finishes_is_forgotten(dog):
    stuck = Event()
    dog._add(stuck, "w", lambda: setattr(stuck, "done", True))
    clock.sleep(0.25)
    dog.poll()
    dog.poll()
    assert dog.failures == ["w (still pending after 0.2s)"] and not dog.overdue() and not dog.exits


def test_one_hardware_queue_diagnoses_without_a_release(dog, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    one_queue = wd.Watchdog(timeout_s=0.1, on_failure=dog.failures.append, poll_s=3600)
    dog.others.append(one_queue)
    one_queue._add(Event(), "w", lambda: dog.released.append(1))
    clock.sleep(0.15)
    one_queue.poll()
    assert dog.failures == ["w (still pending after 0.1s)"] and dog.released == []


def test_a_device_failure_names_every_wait_then_pending(dog):
    error = "CUDA error: unspecified launch failure\nmore lines"
    dog._add(Event(error=error), "rank 0/2 waited for the barrier starting 'fc1_fprop'", lambda: None)
    dog._add(Event(error=error), "rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1", lambda: None)
    dog.poll()  # within the timeout: a dead context is reported at once
    assert dog.failures == [
        "rank 0/2 waited for the barrier starting 'fc1_fprop' | rank 0/2 waited for 'fc1_fprop' "
        "chunk 1 from rank 1 (the device reported an error meanwhile: CUDA error: unspecified "
        "launch failure)"]
    dog._add(Event(error=error), "later", lambda: None)
    dog.poll()
    dog.poll()
    assert len(dog.failures) == 2  # each wait is named once


def test_at_exit_pending_waits_are_named_not_released(dog, capfd):
    dog._add(Event(error="CUDA error: an illegal instruction was encountered"), "w", lambda: None)
    dog._add(Event(), "v", lambda: dog.released.append(1))
    clock.sleep(0.25)
    dog._at_exit()
    err = capfd.readouterr().err
    assert "megatron_overlap watchdog: v (still pending after 0.2s)" in err
    assert "megatron_overlap watchdog: w (the device reported an error meanwhile: CUDA error: " \
           "an illegal instruction" in err
    assert not dog.released and not dog.exits
