// fusedloss: everything a trainer needs, in one include.
#pragma once
#include "fusedloss/config.h"
#include "fusedloss/communicator.h"
#include "fusedloss/cross_entropy.h"
#include "fusedloss/linear_cross_entropy.h"
#include "fusedloss/linear_distillation.h"
#include "fusedloss/linear_log_probs.h"
#include "fusedloss/options.h"
#include "fusedloss/rms_norm.h"
#include "fusedloss/scratch.h"
#include "fusedloss/swiglu.h"
#include "fusedloss/types.h"
