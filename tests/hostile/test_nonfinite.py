"""Silent numerical failure (issue 51, class 5): a training run whose gradient norm or loss
stops being finite ends with an error that names the step, exits non-zero, and keeps the
last good checkpoint byte for byte; it never prints "done" over NaN weights. The NaN is
made by a learning rate so large that the first update overflows (an oracle that needs no
knowledge of kiln's internals: f32 weights times 1e38 overflow)."""
import os
from hostile import Suite

s = Suite(__doc__)
d = s.dir("nonfinite")
corpus = s.corpus(d)
base = ["train", "--data", corpus, "--layers", "1", "--width", "32", "--heads", "2", "--batch", "2", "--context", "32",
        "--eval-every", "0", "--threads", "1", "--warmup", "0"]
run = os.path.join(d, "run")
# a good checkpoint first
s.case("a short run saves a checkpoint (set-up)", base + ["--out", run, "--steps", "2"], rc=0, msg=r"done: ")
model = os.path.join(run, "model.safetensors")
before = open(model, "rb").read()
s.case("a learning rate that overflows the weights stops the run at the step it happens, naming it",
       base + ["--out", run, "--resume", "--steps", "6", "--lr", "1e38", "--min-lr", "1e38", "--clip", "0"],
       rc=1, msg=r"(loss|gradient norm) became (NaN|inf|-inf) at step [3-6]", nomsg=r"\ndone: ")
s.check(open(model, "rb").read() == before, "the last good checkpoint is kept byte for byte")
s.case("the kept run resumes at its saved step", base + ["--out", run, "--resume", "--steps", "3"], rc=0,
       msg=r"resumed .* at step 2")
# A softcap so small that its gradient is NaN while the loss stays finite: refused when
# parsed (a softcap must be a normal number) or stopped at its first step; never "done".
s.case("a NaN gradient with a finite loss is not trained through",
       base + ["--out", os.path.join(d, "softcap"), "--steps", "3", "--attention", "softcap:1e-320"],
       rc=[1, 2], msg=r"(gradient norm became NaN at step 1|softcap)", nomsg=r"\ndone: ")
s.done()
