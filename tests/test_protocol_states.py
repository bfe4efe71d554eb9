"""The protocol's vocabulary (migrate/protocol/states.py): states equal to their wire strings, the legal
moves between them checked per state class."""

from __future__ import annotations

import pytest


def test_protocol_states_are_their_wire_strings_and_moves_are_checked():
    import json

    from relayout.migrate.protocol.states import (
        IllegalTransition,
        IncomingState,
        OutgoingState,
        Phase,
        check_transition,
    )

    assert json.dumps({"incoming": IncomingState.PLACED}) == '{"incoming": "placed"}'
    assert f"{Phase.PRE_COPY}:3" == "pre-copy:3" and OutgoingState.RELEASED == "released"
    assert check_transition(OutgoingState.PAUSED, OutgoingState.RELEASED) is OutgoingState.RELEASED
    for old, new in ((OutgoingState.ACTIVE, OutgoingState.RELEASED),  # a release needs the final round first
                     (OutgoingState.RELEASED, OutgoingState.ABORTED), (IncomingState.COMMITTED, IncomingState.EXPIRED),
                     (IncomingState.RECEIVING, IncomingState.COMMITTED)):
        with pytest.raises(IllegalTransition, match=f"{old} -> {new}"):
            check_transition(old, new)


def test_abort_and_expiry_during_pre_copy_end_the_transfer():
    """The moves every transfer makes: active -> aborted / expired (pre-copy), one class's "active" not
    confused with another's (the states are equal to their wire strings)."""
    from relayout.migrate.protocol.states import TRANSITIONS, OutgoingState, ProtectionState, check_transition

    assert OutgoingState.ACTIVE == ProtectionState.ACTIVE  # why TRANSITIONS is keyed per class
    assert check_transition(OutgoingState.ACTIVE, OutgoingState.ABORTED) is OutgoingState.ABORTED
    assert check_transition(OutgoingState.ACTIVE, OutgoingState.EXPIRED) is OutgoingState.EXPIRED
    assert check_transition(ProtectionState.ACTIVE, ProtectionState.FENCED) is ProtectionState.FENCED
    assert len(TRANSITIONS[OutgoingState]) == 2 and len(TRANSITIONS[ProtectionState]) == 2
