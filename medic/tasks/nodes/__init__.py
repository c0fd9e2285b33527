"""Operations on nodes that the stages share: taking one out of service under the guardrail slot and
returning it, containment before a flow run, the evidence a decision reads, spares, keeping what a
repair destroys, and settling actions a crash left unconfirmed."""
