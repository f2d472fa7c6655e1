"""A worker's num_tokens in stats() counts what it made up to the call, not up to its last heartbeat."""

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.transport.messages import SamplingParams


async def test_stats_count_the_tokens_made_since_the_last_heartbeat():
    # Heartbeats far apart: none reports the batch's tokens before stats() is called.
    config = FleetConfig(engine="echo", num_workers=1, frontend_addr=None, heartbeat_interval_s=30.0,
                         heartbeat_timeout_s=60.0)
    async with Supervisor(config) as fleet:
        results = await fleet.client().generate_batch([[1, 2, 3]] * 4, SamplingParams(max_tokens=20, ignore_eos=True))
        made = sum(len(r.token_ids) for r in results)
        (worker,) = (await fleet.stats())["workers"]
        assert worker["num_tokens"] == made == 80
        (worker,) = (await fleet.stats(engines=False))["workers"]
        assert worker["num_tokens"] == 80  # kept for the calls that ask no engine
