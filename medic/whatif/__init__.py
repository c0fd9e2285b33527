"""What-if tools over the policy language: a policy's own test cases (`testing`), an edit decided again
over the store's recorded incidents (`replay`, `replay_report`) and a simulated fleet's months under a
policy (`fleetsim`). They run the engine; the engine knows nothing of them (pyproject.toml's contracts).
"""
