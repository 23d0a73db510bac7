"""The embedded text the demo's tiny models learn (written for this project)."""

CORPUS = """\
A speculative round has five phases. The drafter proposes a few tokens, the target model \
verifies them all in one forward pass, the engine accepts the longest prefix the target \
agrees with, rolls the cache back past the rejected rows, and the drafter catches up with \
what was committed. When the drafter guesses well, one verify pass commits several tokens \
for the price of one, and decoding runs faster without changing a single output token.
The phase clock drains the streams of every engine that ran a phase before it stamps the \
time, so the device work lands in the bucket that caused it. The numbers it reports are \
shares of a round, not the wall time of an untraced round, because the drains serialize \
what would otherwise overlap.
A pipeline splits the layers of the model into stages, one stage on each device. The \
activations of a verify pass travel from the first stage to the last and then to the head, \
which holds the final norm, the output projection, sampling and acceptance. Every stage \
keeps only the cache rows of its own layers, and a rollback is a change of length, not a \
copy of the cache.
Every phase of every round becomes a span with its start and end taken from the clock, \
and each span carries the free memory of the devices that ran it. The spans of one request \
share one trace, across the driver, the stage actors and the head, so a slow round can be \
found in a trace viewer and read phase by phase.
Greedy decoding with a drafter gives exactly the tokens that plain greedy decoding gives. \
Sampled decoding uses rejection sampling: a drafted token is kept with the probability the \
target gives it over the probability the drafter gave it, and a rejected position draws \
from what is left of the target distribution, so every committed token follows the target.
"""
