"""The replica words are the contract's (issue 19): one enum, the same object wherever
it is imported from, and its values the words every view prints."""

from llmgw_contract import ReplicaState
from llmgw_contract.states import ModelState


def test_replica_states_are_the_words_the_views_print() -> None:
    assert [s.value for s in ReplicaState] == ["serving", "loading", "failing", "stopped"]
    # A StrEnum: JSON, tables and comparisons with the plain strings of older documents agree.
    assert ReplicaState.STOPPED == "stopped" and f"{ReplicaState.FAILING}" == "failing"


def test_the_old_import_path_names_the_contracts_enum() -> None:
    from planner.model.status import ReplicaState as from_status

    assert from_status is ReplicaState


def test_replica_words_are_model_words_too() -> None:
    # A replica's words are a subset of the model's, so a one-replica view reads the same.
    assert {s.value for s in ReplicaState} <= {s.value for s in ModelState}
