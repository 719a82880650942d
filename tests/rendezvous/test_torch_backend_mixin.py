"""torch's own ``RendezvousBackend`` test cases, run against our backend (issue #9.1).

A port of the cases of ``RendezvousBackendTestMixin`` in pytorch's
``test/distributed/elastic/rendezvous/rendezvous_backend_test.py`` (the mixin torch runs
against its c10d and etcd backends; it is not shipped in the wheel, so its cases are
restated here one for one, same names and assertions).

One documented difference is adapted (``docs/rendezvous.md``, Security): our backend
only stores payloads that are our JSON state (:mod:`slurm_elastic.rendezvous.state`; it
checks them strictly, and a payload that is not a state is a malformed record). torch's
cases use opaque byte strings (``b"x"``, ``b"y"``, ``b"z"``); here each is mapped to a
distinct encoded state by :func:`_payload`. Nothing else is changed.
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path
from typing import Any, cast

from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from slurm_elastic.rendezvous.backend import FileRendezvousBackend
from slurm_elastic.rendezvous.state import State, encode_state


def _payload(tag: bytes) -> bytes:
    """The documented adaptation: an opaque tag becomes a distinct pickled state."""
    return encode_state(State(round=int.from_bytes(tag, "big")))


class RendezvousBackendCases:
    """The cases of torch's mixin (``_backend`` and ``_corrupt_state`` by subclasses)."""

    _backend: RendezvousBackend

    # unittest.TestCase methods, for type checkers
    assertEqual: Any
    assertNotEqual: Any
    assertIsNone: Any
    assertIsNotNone: Any
    assertRaises: Any
    assertTrue: Any
    assertFalse: Any

    def _corrupt_state(self) -> None:
        raise NotImplementedError

    def _set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Token, bool]:
        result = self._backend.set_state(state, token)
        self.assertIsNotNone(result)
        return cast(tuple[bytes, Token, bool], result)

    def test_get_state_returns_backend_state(self) -> None:
        self._backend.set_state(_payload(b"x"))
        result = self._backend.get_state()
        self.assertIsNotNone(result)
        state, token = cast(tuple[bytes, Token], result)
        self.assertEqual(_payload(b"x"), state)
        self.assertIsNotNone(token)

    def test_get_state_returns_none_if_backend_state_does_not_exist(self) -> None:
        result = self._backend.get_state()
        self.assertIsNone(result)

    def test_get_state_raises_error_if_backend_state_is_corrupt(self) -> None:
        self._corrupt_state()
        with self.assertRaises(RendezvousStateError):
            self._backend.get_state()

    def test_set_state_sets_backend_state_if_it_does_not_exist(self) -> None:
        state, token, has_set = self._set_state(_payload(b"x"))
        self.assertEqual(_payload(b"x"), state)
        self.assertIsNotNone(token)
        self.assertTrue(has_set)

    def test_set_state_sets_backend_state_if_token_is_current(self) -> None:
        _, token1, has_set1 = self._set_state(_payload(b"x"))
        state2, token2, has_set2 = self._set_state(_payload(b"y"), token1)
        self.assertEqual(_payload(b"y"), state2)
        self.assertNotEqual(token1, token2)
        self.assertTrue(has_set1)
        self.assertTrue(has_set2)

    def test_set_state_returns_current_backend_state_if_token_is_old(self) -> None:
        _, token1, _ = self._set_state(_payload(b"x"))
        state2, token2, _ = self._set_state(_payload(b"y"), token1)
        state3, token3, has_set = self._set_state(_payload(b"z"), token1)
        self.assertEqual(state2, state3)
        self.assertEqual(token2, token3)
        self.assertFalse(has_set)

    def test_set_state_returns_current_backend_state_if_token_is_none(self) -> None:
        state1, token1, _ = self._set_state(_payload(b"x"))
        state2, token2, has_set = self._set_state(_payload(b"y"))
        self.assertEqual(state1, state2)
        self.assertEqual(token1, token2)
        self.assertFalse(has_set)

    def test_set_state_returns_current_backend_state_if_token_is_invalid(self) -> None:
        state1, token1, _ = self._set_state(_payload(b"x"))
        state2, token2, has_set = self._set_state(_payload(b"y"), token="invalid")
        self.assertEqual(state1, state2)
        self.assertEqual(token1, token2)
        self.assertFalse(has_set)


class FileRendezvousBackendTest(unittest.TestCase, RendezvousBackendCases):
    """torch's cases against :class:`FileRendezvousBackend` on a private directory."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self._path = Path(self._tmp.name) / "state"
        self._path.mkdir(mode=0o700)
        self._backend = FileRendezvousBackend(self._path)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def _corrupt_state(self) -> None:
        # What torch's c10d test does (the stored value does not decode), as a file:
        # generation 1 holds bytes that are not a record.
        (self._path / "seg.0" / "state.1").write_bytes(b"non_base64")
