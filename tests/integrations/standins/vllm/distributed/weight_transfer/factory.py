"""Stand-in for vllm/distributed/weight_transfer/factory.py
(vllm-project/vllm @ 047c993cc49c32e9b94f5bf826a9214e163eb982): engines registered by
(name, module path, class name) and imported only when created; the trainer-side factory."""
import importlib

from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name: str, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            module_path = module_path_or_cls
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")

            def loader():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)

            cls._registry[name] = loader
        else:
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls

    @classmethod
    def create_engine(cls, config, vllm_config, device, model) -> WeightTransferEngine:
        backend = config.backend
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available engines: {list(cls._registry.keys())}")
        engine_cls = cls._registry[backend]()
        return engine_cls(config, vllm_config, device, model)


class WeightTransferTrainerFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name: str, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer trainer engine '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            module_path = module_path_or_cls
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")

            def loader():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)

            cls._registry[name] = loader
        else:
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls

    @classmethod
    def trainer_init(cls, backend, config, init_info, *, client, source) -> TrainerWeightTransferEngine:
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available trainer engines: {list(cls._registry.keys())}")
        engine_cls = cls._registry[backend]()
        return engine_cls.trainer_init(config=config, init_info=init_info, client=client, source=source)


WeightTransferEngineFactory.register_engine(
    "nccl", "vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine")
