"""/v1/files and /v1/batches in OpenAI's shapes (thin: parse, call a service or selector, present)."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import ApiKeyAuthentication
from errors import InvalidRequest
from openai_api.errors import drf_exception_handler
from openai_api.serializers import ErrorSerializer

from . import presenters, selectors, services
from .serializers import (
    BatchCreateSerializer,
    BatchListSerializer,
    BatchSerializer,
    FileDeletedSerializer,
    FileListSerializer,
    FileSerializer,
    FileUploadSerializer,
)

ERRORS = {400: ErrorSerializer, 401: ErrorSerializer, 404: ErrorSerializer}
PAGE_PARAMS = [
    OpenApiParameter("after", str, description="cursor: the id of the last object of the previous page"),
    OpenApiParameter("limit", int, description="1..100, default 20"),
]


class JSONRegardlessOfAccept(BaseContentNegotiation):
    """OpenAI's API answers JSON (or raw bytes) whatever Accept says; the SDK sends application/binary."""

    def select_parser(self, request, parsers):
        for parser in parsers:
            if parser.media_type.split(";")[0] == (request.content_type or "").split(";")[0]:
                return parser
        return None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class V1View(APIView):
    authentication_classes = [ApiKeyAuthentication]
    content_negotiation_class = JSONRegardlessOfAccept
    permission_classes = [permissions.IsAuthenticated]

    def get_exception_handler(self):
        return drf_exception_handler

    def json_body(self, request) -> dict:
        data = request.data
        if not isinstance(data, dict):
            raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
        return data


class FilesView(V1View):
    parser_classes = [MultiPartParser, FormParser, JSONParser]

    @extend_schema(
        operation_id="listFiles",
        parameters=PAGE_PARAMS
        + [OpenApiParameter("purpose", str), OpenApiParameter("order", str, enum=["asc", "desc"])],
        responses={200: FileListSerializer, **ERRORS},
    )
    def get(self, request):
        files, has_more = selectors.files_page(
            request.user,
            purpose=request.query_params.get("purpose") or None,
            after=request.query_params.get("after") or None,
            limit=selectors.page_limit(request.query_params.get("limit"), default=10000, maximum=10000),
            order=request.query_params.get("order", "desc"),
        )
        return Response(presenters.list_object([presenters.file_object(f) for f in files], has_more))

    @extend_schema(
        operation_id="createFile",
        request={"multipart/form-data": FileUploadSerializer},
        responses={200: FileSerializer, **ERRORS},
    )
    def post(self, request):
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidRequest("Missing the multipart field 'file'.", code="missing_required_parameter", param="file")
        file = services.upload_file(
            request.user, content=upload.read(), filename=upload.name, purpose=request.data.get("purpose", "")
        )
        return Response(presenters.file_object(file))


class FileView(V1View):
    @extend_schema(operation_id="retrieveFile", responses={200: FileSerializer, **ERRORS})
    def get(self, request, file_id: str):
        return Response(presenters.file_object(selectors.get_file(request.user, file_id)))

    @extend_schema(operation_id="deleteFile", responses={200: FileDeletedSerializer, **ERRORS})
    def delete(self, request, file_id: str):
        services.delete_file(request.user, file_id)
        return Response({"id": file_id, "object": "file", "deleted": True})


class FileContentView(V1View):
    @extend_schema(
        operation_id="downloadFile", responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **ERRORS}
    )
    def get(self, request, file_id: str):
        file = selectors.get_file(request.user, file_id)
        return file_download(file)


def file_download(file) -> HttpResponse:
    response = HttpResponse(bytes(file.content), content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="{file.filename}"'
    return response


class BatchesView(V1View):
    parser_classes = [JSONParser]

    @extend_schema(operation_id="listBatches", parameters=PAGE_PARAMS, responses={200: BatchListSerializer, **ERRORS})
    def get(self, request):
        batches, has_more = selectors.batches_page(
            request.user,
            after=request.query_params.get("after") or None,
            limit=selectors.page_limit(request.query_params.get("limit")),
        )
        return Response(presenters.list_object([presenters.batch_object(b) for b in batches], has_more))

    @extend_schema(
        operation_id="createBatch", request=BatchCreateSerializer, responses={200: BatchSerializer, **ERRORS}
    )
    def post(self, request):
        body = self.json_body(request)
        batch = services.create_batch(
            request.user,
            input_file_id=body.get("input_file_id"),
            endpoint=body.get("endpoint"),
            completion_window=body.get("completion_window"),
            metadata=body.get("metadata"),
        )
        return Response(presenters.batch_object(batch))


class BatchView(V1View):
    @extend_schema(operation_id="retrieveBatch", responses={200: BatchSerializer, **ERRORS})
    def get(self, request, batch_id: str):
        return Response(presenters.batch_object(selectors.get_batch(request.user, batch_id)))


class BatchCancelView(V1View):
    @extend_schema(operation_id="cancelBatch", request=None, responses={200: BatchSerializer, **ERRORS})
    def post(self, request, batch_id: str):
        return Response(presenters.batch_object(services.cancel_batch(request.user, batch_id)))
