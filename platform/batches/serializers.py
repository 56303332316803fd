"""Request validation and (for the OpenAPI schema) the response shapes of /v1/files and /v1/batches."""

from rest_framework import serializers


class FileUploadSerializer(serializers.Serializer):
    file = serializers.FileField()
    purpose = serializers.CharField()


class FileSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="file")
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField()
    expires_at = serializers.IntegerField(allow_null=True)
    filename = serializers.CharField()
    purpose = serializers.CharField(help_text="batch | batch_output")
    status = serializers.CharField()
    status_details = serializers.CharField(allow_null=True)


class FileListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    data = FileSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class FileDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="file")
    deleted = serializers.BooleanField()


class BatchCreateSerializer(serializers.Serializer):
    input_file_id = serializers.CharField()
    endpoint = serializers.CharField(help_text="/v1/chat/completions, /v1/completions or /v1/embeddings")
    completion_window = serializers.CharField(help_text="24h")
    metadata = serializers.DictField(child=serializers.CharField(), required=False, allow_null=True)


class BatchErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    line = serializers.IntegerField(allow_null=True)


class BatchErrorsSerializer(serializers.Serializer):
    object = serializers.CharField()
    data = BatchErrorSerializer(many=True)


class RequestCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class BatchUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    input_tokens_details = serializers.DictField(child=serializers.IntegerField())
    output_tokens = serializers.IntegerField()
    output_tokens_details = serializers.DictField(child=serializers.IntegerField())
    total_tokens = serializers.IntegerField()


class BatchSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="batch")
    endpoint = serializers.CharField()
    errors = BatchErrorsSerializer(allow_null=True)
    input_file_id = serializers.CharField()
    completion_window = serializers.CharField()
    status = serializers.CharField()
    output_file_id = serializers.CharField(allow_null=True)
    error_file_id = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField()
    in_progress_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField()
    finalizing_at = serializers.IntegerField(allow_null=True)
    completed_at = serializers.IntegerField(allow_null=True)
    failed_at = serializers.IntegerField(allow_null=True)
    expired_at = serializers.IntegerField(allow_null=True)
    cancelling_at = serializers.IntegerField(allow_null=True)
    cancelled_at = serializers.IntegerField(allow_null=True)
    request_counts = RequestCountsSerializer()
    metadata = serializers.DictField(child=serializers.CharField(), allow_null=True)
    usage = BatchUsageSerializer()
    paused_reason = serializers.CharField(allow_null=True, help_text="why an in_progress batch waits (Tessera)")


class BatchListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    data = BatchSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()
