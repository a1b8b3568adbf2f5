"""Structured output (docs/structured_output.md): the contract (spec.py: what a request's text must
match, what a grammar may cost; no llguidance), llguidance's matchers (grammars.py) and the child
process that tries each new grammar first (grammar_sandbox.py). Import the module you need: this
package imports none of them, so that the contract comes without the others."""
