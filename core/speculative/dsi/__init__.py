"""DSI, speculation parallelism (Timor et al., seed 002; algorithms.md section 6).

Drafting never waits for verification. The drafter keeps extending a speculative chain beyond the
committed text; every `lookahead` draft tokens, a verification task (the committed text and every
draft so far) goes to a free target instance while drafting goes on. The frontier (the next
position to commit) is always covered by a task: after each resolution the instance that just
answered is free, and if no task still covers the new frontier it gets one at once, with whatever
drafts exist (none: a plain task). So a rejection costs one target latency, exactly what plain
decoding pays per token, and every accepted draft costs only drafting time. Where blocks would
wait for instances anyway (few instances, a fast drafter), the cost model may instead let the new
frontier wait for a lookahead of drafts: no instance then verifies a lone token.

Resolution uses the chain rule of verify.py position by position, so the text is distributed
exactly as the target's (greedy: identical): a task's rows are the target's P at consecutive
positions, drafts there are accepted with min(1, P/Q), the first rejection takes a token from the
residual and cancels every task built on the rejected draft. A task whose drafts are all accepted
checks the next draft too with its last row; if there is none yet, that row gives the bonus token.
Which task resolves which position depends on timing, never on a draft's value, so exactness
holds whatever the instances' speeds.

Every task costs a handoff to an instance and back, and every cancelled one a message. Where
the cost model, pricing a task at its measured latency with that handoff, says the instances
cannot beat plain steps (drafts that keep failing, a drafter as slow as the target), the
orchestrator runs plain steps on the engine's own target instead, measuring the drafter's next
draft against each (min(1, P/Q) at its token: no verification, no pass over the vocabulary),
and goes back to the instances once the acceptance so measured says they pay. A plain step
samples the target's P at the frontier itself, and whether to take one depends on past
verdicts only: exactness holds there too.

The package: orchestrator.py (`DsiDecoder`: the tasks, their resolution, the drafting thread),
policy.py (`DsiPolicy`: every decision, from what the orchestrator measured; pure), pool.py (the
target instances: threads or worker processes) and cost.py (the cost model; pure, no torch).
Nothing is imported here, so that the planner can import cost.py without torch.
"""
