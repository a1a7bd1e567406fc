"""Hostile basics: mistyped verbs and options, missing values and missing inputs get a
clear error and exit status 2 (usage) or 1 (failure), never a crash, and touch nothing."""
import os
from hostile import Suite

s = Suite(__doc__)
d = s.dir("basics")
s.case("an unknown verb is a usage error", ["trian"], rc=2, msg=r"unknown command 'trian'", untouched=[d])
s.case("an unknown option is named", ["sample", "--bogus", "1"], rc=2, msg=r"unknown option '--bogus'",
       untouched=[d])
s.case("an option without its value is named", ["sample", "--temperature"], rc=2,
       msg=r"--temperature needs a value", untouched=[d])
s.case("an integer option given text is named", ["train", "--steps", "many", "--out", os.path.join(d, "r")],
       rc=2, msg=r"--steps must be a whole number", untouched=[d])
s.case("a model folder that does not exist is named", ["sample", os.path.join(d, "nope")], rc=1,
       msg=r"nope", untouched=[d])
s.done()
