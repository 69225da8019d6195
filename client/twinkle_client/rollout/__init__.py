"""Client-side rollouts (upstream's ``twinkle_client.rollout``): `ClientMultiTurnRollout`."""

from twinkle_client.rollout.multi_turn import ClientMultiTurnRollout

__all__ = ["ClientMultiTurnRollout"]
